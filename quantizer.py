"""Finite scalar quantisation (Mentzer et al. 2023) of vision tokens into 4-bit codes.

Two quantizers share the scalar part (`ScalarCodes`: bound each scalar to L levels, round with a
straight-through gradient, name the level by a code 0..L-1) and the wire format (T*dims codes,
token-major, two a byte):
- `CrossTokenFSQ`, the one a frozen base needs: small transformers attend across all T tokens on
  both sides, so the 4096 scalars go where the page has something to say (a blank token's codes
  can carry a dense neighbour's detail) instead of 16 linear directions per token.
- `FSQ`, per token: a linear projection (pseudo-inverse pair) with optional residual MLPs; the
  bottleneck that `train.py base --bottleneck` folds into a base's projector.
A quantizer's sizes live in its JSON sidecar (quantizer.json), so a file rebuilds what it holds.
Only the quantizer learns; the base stays frozen.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ocr_latent.architecture import pack, unpack  # noqa: F401 - the wire format


class ScalarCodes(nn.Module):
    """z [.., dims] --tanh bound--> u in (-L/2, L/2) --round--> level --> code = level + L//2.

    Even level counts sit between integers: the bound is shifted by half a step so that rounding
    gives exactly L values."""

    kind = ""

    def __init__(self, embed_dim: int, tokens: int, levels: list[int]):
        super().__init__()
        assert all(2 <= l <= 16 for l in levels), "4-bit codes need 2..16 levels per dimension"
        self.embed_dim, self.tokens, self.levels, self.dims = embed_dim, tokens, list(levels), len(levels)
        L = torch.tensor(levels, dtype=torch.float32)
        self.register_buffer("half_range", (L - 1) / 2 * (1 + 1e-3), persistent=False)  # tanh scale
        self.register_buffer("offset", (1 - L % 2) / 2, persistent=False)
        self.register_buffer("half_width", L // 2, persistent=False)  # code = level + half_width

    @property
    def num_codes(self) -> int:
        return self.tokens * self.dims

    def bound(self, z: Tensor) -> Tensor:
        return torch.tanh(z + torch.atanh(self.offset / self.half_range)) * self.half_range - self.offset

    def unbound(self, u: Tensor) -> Tensor:
        return torch.atanh((u + self.offset) / self.half_range) - torch.atanh(self.offset / self.half_range)

    def to_codes(self, levels: Tensor) -> Tensor:
        """Rounded levels [B, T, dims] -> codes [B, T*dims] uint8."""
        return (levels + self.half_width).to(torch.uint8).flatten(1)

    def to_levels(self, codes: Tensor) -> Tensor:
        """Codes [B, T*dims] (any int dtype) -> levels [B, T, dims] float32."""
        return codes.reshape(codes.shape[0], self.tokens, self.dims).float() - self.half_width

    # --------------------------------------------------------------------------- files
    def geometry(self) -> dict:
        return {"kind": self.kind, "embed_dim": self.embed_dim, "tokens": self.tokens, "dims": self.dims,
                "levels": self.levels, "num_codes": self.num_codes, "bits_per_code": 4, **self.sizes()}

    def sizes(self) -> dict:
        return {}

    def save(self, path: str | Path, meta: dict) -> None:
        path = Path(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))
        path.with_suffix(".json").write_text(json.dumps({**meta, **self.geometry()}, indent=1) + "\n")

    def fingerprint(self, base_fingerprint: str) -> str:
        """16 hex digits naming what codes mean: this quantizer's geometry and weights, and the base it
        was trained for. Codes files (codesfile.py) carry it, so codes are never decoded by another one."""
        h = hashlib.sha256(json.dumps({**self.geometry(), "base_fingerprint": base_fingerprint}, sort_keys=True).encode())
        for name, t in sorted(self.state_dict().items()):
            t = t.detach().float().cpu().contiguous()
            h.update(f"{name}:{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path) -> tuple["ScalarCodes", dict]:
        """Any quantizer file: its sidecar names the kind (files without one are per-token FSQs)."""
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        kind = {"token": FSQ, "cross_token": CrossTokenFSQ}.get(meta.get("kind") or "token")
        if kind is None:
            raise ValueError(f"{path}: unknown quantizer kind {meta.get('kind')!r}")
        q = kind.from_geometry(meta)
        q.load_state_dict(load_file(str(path)))
        return q, meta


# ----------------------------------------------------------------------------- across tokens
class Block(nn.Module):
    """Pre-norm transformer block: self-attention over all tokens of a page, then an MLP."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class Mixer(nn.Module):
    """[B, T, d_in] -> [B, T, d_out]: a linear map in, learned positions, `depth` blocks, a linear map out."""

    def __init__(self, d_in: int, d_out: int, tokens: int, width: int, depth: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(d_in, width), nn.Linear(width, d_out)
        self.pos = nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj_in(x) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.proj_out(self.norm(x))


class CrossTokenFSQ(ScalarCodes):
    """features [B, T, D] --compress (attention across tokens)--> z [B, T, dims] --bound, round-->
    codes; codes --levels / (L//2)--> decompress (attention across tokens) --> features [B, T, D].

    Code slot t is not tied to token t: the compressor may spend any slot on any part of the page."""

    kind = "cross_token"

    def __init__(self, embed_dim: int, tokens: int, levels: list[int], width: int = 192, depth: int = 2,
                 heads: int = 4, mlp_ratio: int = 2):
        super().__init__(embed_dim, tokens, levels)
        self.width, self.depth, self.heads, self.mlp_ratio = width, depth, heads, mlp_ratio
        self.compress = Mixer(embed_dim, self.dims, tokens, width, depth, heads, mlp_ratio)
        self.decompress = Mixer(self.dims, embed_dim, tokens, width, depth, heads, mlp_ratio)

    @classmethod
    def from_geometry(cls, g: dict) -> "CrossTokenFSQ":
        return cls(g["embed_dim"], g["tokens"], g["levels"], g["width"], g["depth"], g["heads"], g["mlp_ratio"])

    def sizes(self) -> dict:
        return {"width": self.width, "depth": self.depth, "heads": self.heads, "mlp_ratio": self.mlp_ratio}

    def quantize(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Bounded scalars u [B, T, dims] and their rounding with a straight-through gradient."""
        u = self.bound(self.compress(features.float()))
        return u, u + (u.round() - u).detach()

    def forward(self, features: Tensor) -> Tensor:
        """Training path: features -> codes' levels -> reconstructed features, straight through the rounding."""
        return self.decompress(self.quantize(features)[1] / self.half_width)

    def encode(self, features: Tensor) -> Tensor:
        return self.to_codes(self.quantize(features)[1])

    def decode(self, codes: Tensor) -> Tensor:
        return self.decompress(self.to_levels(codes) / self.half_width)


# ----------------------------------------------------------------------------- per token
class FSQ(ScalarCodes):
    """features --proj_in--> z [.., dims] --tanh bound--> u in (-L/2, L/2) --round--> level --> code.

    The way back maps a level to the z whose bound it is (the exact inverse of the tanh), then
    proj_out. proj_in is the pseudo-inverse of the learned proj_out, so codes -> features -> codes
    is the identity by construction, and the straight-through gradient w.r.t. z is exactly 1.

    With `hidden` > 0 each side also gets a residual MLP (zero-initialised, so training starts from
    the linear quantizer): a linear map to `dims` coordinates can only keep the top `dims` principal
    directions, and a feature set whose information is spread wider needs a nonlinear code."""

    kind = "token"

    def __init__(self, embed_dim: int, tokens: int, levels: list[int], hidden: int = 0):
        super().__init__(embed_dim, tokens, levels)
        self.hidden = hidden
        self.proj_out = nn.Linear(self.dims, embed_dim)
        nn.init.orthogonal_(self.proj_out.weight)
        if hidden:
            mlp = lambda i, o: nn.Sequential(nn.Linear(i, hidden), nn.GELU(), nn.Linear(hidden, o))
            self.mlp_in, self.mlp_out = mlp(embed_dim, self.dims), mlp(self.dims, embed_dim)
            for m in (self.mlp_in, self.mlp_out):
                nn.init.zeros_(m[2].weight), nn.init.zeros_(m[2].bias)

    @classmethod
    def from_geometry(cls, g: dict) -> "FSQ":
        return cls(g["embed_dim"], g["tokens"], g["levels"], g.get("hidden", 0))

    def sizes(self) -> dict:
        return {"hidden": self.hidden}

    def proj_in(self, features: Tensor) -> Tensor:
        """Least-squares inverse of proj_out: features [.., D] -> z [.., dims]."""
        pinv = torch.linalg.pinv(self.proj_out.weight.float())
        z = (features.float() - self.proj_out.bias.float()) @ pinv.T
        return z + self.mlp_in(features.float()) if self.hidden else z

    def features_of(self, z: Tensor) -> Tensor:
        return self.proj_out(z) + self.mlp_out(z) if self.hidden else self.proj_out(z)

    def forward(self, features: Tensor) -> Tensor:
        """Training path: features -> quantised -> reconstructed features, straight-through."""
        z = self.proj_in(features)
        z_hat = self.unbound(self.bound(z).round())
        return self.features_of(z + (z_hat - z).detach())

    def encode(self, features: Tensor) -> Tensor:
        """[B, T, D] -> codes [B, T*dims] uint8 in 0..L-1."""
        return self.to_codes(self.bound(self.proj_in(features)).round())

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, T*dims] (any int dtype) -> features [B, T, D] float32."""
        return self.features_of(self.unbound(self.to_levels(codes)))

    @torch.no_grad()
    def init_from_pca(self, features: Tensor, spread: float = 0.3) -> None:
        """Start from the top `dims` principal directions, scaled so each z coordinate has std
        `spread`: inside the tanh's near-linear range, where the levels are finely spaced in z."""
        x = features.reshape(-1, self.embed_dim).float()
        mean = x.mean(0)
        _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
        std = s[: self.dims] / (x.shape[0] - 1) ** 0.5
        self.proj_out.weight.copy_(vh[: self.dims].T * (std / spread)[None, :])
        self.proj_out.bias.copy_(mean)


def code_usage(codes: Tensor, q: ScalarCodes) -> dict:
    """How the codes of many pages [N, T*dims] use their 4 bits: per dimension (pooled over tokens)
    the entropy in bits and the share of its levels that occur; over the T*dims code positions, how
    many are dead (one level on every page: bits spent on nothing) and their mean entropy."""
    levels = q.to_levels(codes.to(q.half_width.device)).long() + q.half_width.long()  # [N, T, dims] codes
    L = max(q.levels)

    def entropy(counts: Tensor) -> Tensor:  # counts [..., L] -> bits
        p = counts / counts.sum(-1, keepdim=True)
        return -(p * p.clamp_min(1e-12).log2()).sum(-1)

    per_dim = F.one_hot(levels, L).sum((0, 1)).float()  # [dims, L]
    per_pos = F.one_hot(levels, L).sum(0).float().flatten(0, 1)  # [T*dims, L]
    pos_entropy = entropy(per_pos)
    return {"dim_entropy_bits": [round(float(e), 3) for e in entropy(per_dim)],
            "dim_levels_used": [round(float((c > 0).sum()) / l, 3) for c, l in zip(per_dim, q.levels)],
            "dead_positions": int((per_pos.amax(-1) == per_pos.sum(-1)).sum()),
            "position_entropy_bits_mean": round(float(pos_entropy.mean()), 3), "pages": int(codes.shape[0])}
