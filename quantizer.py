"""Finite scalar quantisation (Mentzer et al. 2023) of vision tokens into 4-bit codes.

features [B, T, D] --proj_in--> [B, T, dims] --tanh bound, round (straight-through)--> integer
levels --> codes 0..L-1, flattened token-major to [B, T*dims]. Decoding maps codes back to the
level grid and through proj_out to [B, T, D]. Both projections are learned; the base is frozen.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


class FSQ(nn.Module):
    def __init__(self, embed_dim: int, tokens: int, levels: list[int]):
        super().__init__()
        assert all(2 <= l <= 16 for l in levels), "4-bit codes need 2..16 levels per dimension"
        self.embed_dim, self.tokens, self.levels = embed_dim, tokens, list(levels)
        self.dims = len(levels)
        L = torch.tensor(levels, dtype=torch.float32)
        self.register_buffer("half_levels", (L - 1) / 2, persistent=False)  # tanh range
        # even level counts sit between integers: shift by half a step so rounding gives L values
        self.register_buffer("offset", (1 - L % 2) / 2, persistent=False)
        self.register_buffer("half_width", L // 2, persistent=False)  # code = level + half_width
        self.proj_in = nn.Linear(embed_dim, self.dims)
        self.proj_out = nn.Linear(self.dims, embed_dim)

    @property
    def num_codes(self) -> int:
        return self.tokens * self.dims

    def bound(self, z: Tensor) -> Tensor:
        shift = torch.atanh(self.offset / (self.half_levels * (1 + 1e-3)))
        return torch.tanh(z + shift) * self.half_levels * (1 + 1e-3) - self.offset

    def quantize(self, features: Tensor) -> Tensor:
        """Continuous features -> rounded levels (straight-through gradient), [B, T, dims]."""
        z = self.bound(self.proj_in(features.float()))
        return z + (z.round() - z).detach()

    def dequantize_levels(self, levels: Tensor) -> Tensor:
        return self.proj_out(levels / self.half_width)

    def forward(self, features: Tensor) -> Tensor:
        """Training path: features -> quantised -> reconstructed features, differentiable."""
        return self.dequantize_levels(self.quantize(features))

    def encode(self, features: Tensor) -> Tensor:
        """[B, T, D] -> codes [B, T*dims] uint8 in 0..L-1."""
        levels = self.quantize(features).round()
        return (levels + self.half_width).to(torch.uint8).flatten(1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, T*dims] (any int dtype) -> features [B, T, D] float32."""
        levels = codes.view(codes.shape[0], self.tokens, self.dims).float() - self.half_width
        return self.dequantize_levels(levels)

    @torch.no_grad()
    def init_from_pca(self, features: Tensor, spread: float = 1.0) -> None:
        """Start from the top `dims` principal directions, scaled so each projected coordinate has
        std `spread` (inside the tanh's linear range), and proj_out as their inverse."""
        x = features.reshape(-1, self.embed_dim).float()
        mean = x.mean(0)
        _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
        basis, std = vh[: self.dims], s[: self.dims] / (x.shape[0] - 1) ** 0.5
        self.proj_in.weight.copy_(basis * (spread / std)[:, None])
        self.proj_in.bias.copy_(-(basis @ mean) * spread / std)
        # levels / half_width recovers z / half_width; undo the scaling back to feature space
        zscale = self.half_width * std / spread  # normalised level -> principal coordinate
        self.proj_out.weight.copy_(basis.T * zscale[None, :])
        self.proj_out.bias.copy_(mean)

    # --------------------------------------------------------------------------- files
    def save(self, path: str | Path, meta: dict) -> None:
        path = Path(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))
        meta = {**meta, **self.geometry()}
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")

    def geometry(self) -> dict:
        return {"embed_dim": self.embed_dim, "tokens": self.tokens, "dims": self.dims, "levels": self.levels,
                "num_codes": self.num_codes, "bits_per_code": 4}

    @classmethod
    def load(cls, path: str | Path) -> tuple["FSQ", dict]:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        fsq = cls(meta["embed_dim"], meta["tokens"], meta["levels"])
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
