"""Finite scalar quantisation (Mentzer et al. 2023) of vision tokens into 4-bit codes.

features [B, T, D] --proj_in--> [B, T, dims] --tanh bound, round (straight-through)--> integer
levels --> codes 0..L-1, flattened token-major to [B, T*dims]. Decoding maps codes back through
the inverse bound and proj_out to [B, T, D]. Only the quantizer learns; the base stays frozen.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


class FSQ(nn.Module):
    """features --proj_in--> z [.., dims] --tanh bound--> u in (-L/2, L/2) --round--> level --> code.

    The way back maps a level to the z whose bound it is (the exact inverse of the tanh), then
    proj_out. proj_in is the pseudo-inverse of the learned proj_out, so codes -> features -> codes
    is the identity by construction, and the straight-through gradient w.r.t. z is exactly 1.

    With `hidden` > 0 each side also gets a residual MLP (zero-initialised, so training starts from
    the linear quantizer): a linear map to `dims` coordinates can only keep the top `dims` principal
    directions, and a feature set whose information is spread wider needs a nonlinear code."""

    def __init__(self, embed_dim: int, tokens: int, levels: list[int], hidden: int = 0):
        super().__init__()
        assert all(2 <= l <= 16 for l in levels), "4-bit codes need 2..16 levels per dimension"
        self.embed_dim, self.tokens, self.levels, self.hidden = embed_dim, tokens, list(levels), hidden
        self.dims = len(levels)
        L = torch.tensor(levels, dtype=torch.float32)
        self.register_buffer("half_range", (L - 1) / 2 * (1 + 1e-3), persistent=False)  # tanh scale
        # even level counts sit between integers: shift by half a step so rounding gives L values
        self.register_buffer("offset", (1 - L % 2) / 2, persistent=False)
        self.register_buffer("half_width", L // 2, persistent=False)  # code = level + half_width
        self.proj_out = nn.Linear(self.dims, embed_dim)
        nn.init.orthogonal_(self.proj_out.weight)
        if hidden:
            mlp = lambda i, o: nn.Sequential(nn.Linear(i, hidden), nn.GELU(), nn.Linear(hidden, o))
            self.mlp_in, self.mlp_out = mlp(embed_dim, self.dims), mlp(self.dims, embed_dim)
            for m in (self.mlp_in, self.mlp_out):
                nn.init.zeros_(m[2].weight), nn.init.zeros_(m[2].bias)

    @property
    def num_codes(self) -> int:
        return self.tokens * self.dims

    def proj_in(self, features: Tensor) -> Tensor:
        """Least-squares inverse of proj_out: features [.., D] -> z [.., dims]."""
        pinv = torch.linalg.pinv(self.proj_out.weight.float())
        z = (features.float() - self.proj_out.bias.float()) @ pinv.T
        return z + self.mlp_in(features.float()) if self.hidden else z

    def features_of(self, z: Tensor) -> Tensor:
        return self.proj_out(z) + self.mlp_out(z) if self.hidden else self.proj_out(z)

    def bound(self, z: Tensor) -> Tensor:
        return torch.tanh(z + torch.atanh(self.offset / self.half_range)) * self.half_range - self.offset

    def unbound(self, u: Tensor) -> Tensor:
        return torch.atanh((u + self.offset) / self.half_range) - torch.atanh(self.offset / self.half_range)

    def forward(self, features: Tensor) -> Tensor:
        """Training path: features -> quantised -> reconstructed features, straight-through."""
        z = self.proj_in(features)
        z_hat = self.unbound(self.bound(z).round())
        return self.features_of(z + (z_hat - z).detach())

    def encode(self, features: Tensor) -> Tensor:
        """[B, T, D] -> codes [B, T*dims] uint8 in 0..L-1."""
        levels = self.bound(self.proj_in(features)).round()
        return (levels + self.half_width).to(torch.uint8).flatten(1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, T*dims] (any int dtype) -> features [B, T, D] float32."""
        levels = codes.reshape(codes.shape[0], self.tokens, self.dims).float() - self.half_width
        return self.features_of(self.unbound(levels))

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

    # --------------------------------------------------------------------------- files
    def save(self, path: str | Path, meta: dict) -> None:
        path = Path(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))
        meta = {**meta, **self.geometry()}
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")

    def geometry(self) -> dict:
        return {"embed_dim": self.embed_dim, "tokens": self.tokens, "dims": self.dims, "levels": self.levels,
                "num_codes": self.num_codes, "bits_per_code": 4, "hidden": self.hidden}

    @classmethod
    def load(cls, path: str | Path) -> tuple["FSQ", dict]:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        fsq = cls(meta["embed_dim"], meta["tokens"], meta["levels"], meta.get("hidden", 0))
        fsq.load_state_dict(load_file(str(path)))
        return fsq, meta


def pack(codes: np.ndarray | Tensor) -> bytes:
    """4096 codes in 0..15 -> 2048 bytes, two codes a byte, the first in the high nibble."""
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if c.size % 2 or c.max(initial=0) > 15:
        raise ValueError("pack needs an even number of codes in 0..15")
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8).tobytes()


def unpack(data: bytes) -> np.ndarray:
    b = np.frombuffer(data, dtype=np.uint8)
    return np.stack([b >> 4, b & 15], axis=1).reshape(-1)
