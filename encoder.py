"""DeepSeek-OCR (v1) DeepEncoder: page image -> view -> SAM-B -> CLIP-L -> projector -> features.

Math follows deepseek-ocr-facts.md §2-3; module and parameter names follow the original checkpoint
(`model.sam_model.*`, `model.vision_model.*`, `model.projector.layers.*`) so a state dict loads
after stripping the `model.` prefix. Every size comes from `VisionConfig` (config.json).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from ocr_latent.views import MODES, PAD_FILL, load_image, make_view  # noqa: F401 - the encoder's preprocessing


@dataclass
class VisionConfig:
    sam_width: int = 768
    sam_layers: int = 12
    sam_heads: int = 12
    sam_global_attn_indexes: tuple[int, ...] = (2, 5, 8, 11)
    sam_downsample_channels: tuple[int, int] = (512, 1024)
    sam_image_size: int = 1024  # the pos_embed grid is sam_image_size / 16
    sam_neck_channels: int = 256
    clip_width: int = 1024
    clip_layers: int = 24
    clip_heads: int = 16
    clip_image_size: int = 224  # position table: (clip_image_size / clip_patch_size)^2 + 1
    clip_patch_size: int = 14
    projector_input_dim: int = 2048
    projector_dim: int = 1280
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionConfig":
        width = cfg["vision_config"]["width"]
        sam, clip, proj = width["sam_vit_b"], width["clip-l-14-224"], cfg["projector_config"]
        return cls(
            sam_width=sam["width"], sam_layers=sam["layers"], sam_heads=sam["heads"],
            sam_global_attn_indexes=tuple(sam["global_attn_indexes"]),
            sam_downsample_channels=tuple(sam["downsample_channels"]),
            sam_image_size=cfg["vision_config"].get("image_size", 1024),
            sam_neck_channels=sam.get("neck_channels", 256),
            clip_width=clip["width"], clip_layers=clip["layers"], clip_heads=clip["heads"],
            clip_image_size=clip.get("image_size", 224), clip_patch_size=clip.get("patch_size", 14),
            projector_input_dim=proj["input_dim"], projector_dim=proj["n_embed"])


# ----------------------------------------------------------------------------- preprocessing (views: views.py)
def view_to_tensor(view: Image.Image) -> Tensor:
    """uint8 HWC -> float CHW in [-1, 1] ((x/255 - 0.5) / 0.5)."""
    return views_to_tensor([view])[0]


def views_to_tensor(views: list[Image.Image]) -> Tensor:
    """A batch [B,3,S,S] of views: stacked as uint8 first (a quarter of the bytes to copy)."""
    x = torch.from_numpy(np.stack([np.asarray(v, dtype=np.uint8) for v in views])).permute(0, 3, 1, 2).float()
    return (x / 255.0 - 0.5) / 0.5


# ----------------------------------------------------------------------------- SAM-B
class LayerNorm2d(nn.Module):
    """LayerNorm over channels of an NCHW map (biased variance), as SAM's neck uses."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels)), eps

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


def resized_rel_pos(table: Tensor, q_size: int, k_size: int) -> Tensor:
    """Relative-position rows R[i, j] = table[i - j + k_size - 1] (q_size == k_size in SAM)."""
    length = 2 * max(q_size, k_size) - 1
    if table.shape[0] != length:  # global blocks off the native grid: linear resample in fp32
        table = F.interpolate(table.float().T[None], size=length, mode="linear")[0].T.to(table.dtype)
    q = torch.arange(q_size, device=table.device)[:, None] * max(k_size / q_size, 1.0)
    k = torch.arange(k_size, device=table.device)[None, :] * max(q_size / k_size, 1.0)
    return table[(q - k + (k_size - 1) * max(q_size / k_size, 1.0)).long()]


class SamAttention(nn.Module):
    def __init__(self, dim: int, heads: int, rel_size: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_size - 1, dim // heads))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_size - 1, dim // heads))

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, C = x.shape
        q, k, v = self.qkv(x).view(B, H * W, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # [B, h, HW, d]
        # decomposed relative position bias, computed from the *unscaled* query
        rq = q.reshape(B, self.heads, H, W, -1)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", rq, resized_rel_pos(self.rel_pos_h, H, H))
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", rq, resized_rel_pos(self.rel_pos_w, W, W))
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(B, self.heads, H * W, H * W)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(B, H, W, C))


class SamMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2(F.gelu(self.lin1(x)))


class SamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, grid: int):
        super().__init__()
        self.window = window  # 0 = global attention over the whole grid
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = SamAttention(dim, heads, window or grid)
        self.mlp = SamMlp(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, C = x.shape
        h = self.norm1(x)
        if self.window:
            # zero-pad to whole windows and attend inside each window with no mask: the padded
            # tokens take part as keys/values, exactly like the original
            ws = self.window
            Hp, Wp = math.ceil(H / ws) * ws, math.ceil(W / ws) * ws
            h = F.pad(h, (0, 0, 0, Wp - W, 0, Hp - H))
            h = h.view(B, Hp // ws, ws, Wp // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, C)
            h = self.attn(h)
            h = h.view(B, Hp // ws, Wp // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
            h = h[:, :H, :W]
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.norm2(x))


class SamEncoder(nn.Module):
    """SAM ViT-B image encoder + neck + the two stride-2 convs DeepSeek-OCR adds (net_2, net_3)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        dim, grid = cfg.sam_width, cfg.sam_image_size // 16
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 16, 16)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, dim))
        self.blocks = nn.ModuleList(
            SamBlock(dim, cfg.sam_heads, 0 if i in cfg.sam_global_attn_indexes else 14, grid)
            for i in range(cfg.sam_layers))
        neck = cfg.sam_neck_channels
        self.neck = nn.Sequential(nn.Conv2d(dim, neck, 1, bias=False), LayerNorm2d(neck),
                                  nn.Conv2d(neck, neck, 3, padding=1, bias=False), LayerNorm2d(neck))
        c2, c3 = cfg.sam_downsample_channels
        self.net_2 = nn.Conv2d(neck, c2, 3, 2, 1, bias=False)
        self.net_3 = nn.Conv2d(c2, c3, 3, 2, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B,3,S,S] -> [B,C3,S/64,S/64]
        x = self.patch_embed.proj(x).permute(0, 2, 3, 1)
        pos = self.pos_embed
        if pos.shape[1] != x.shape[1]:  # other view sizes: bicubic+antialias resample in fp32
            pos = F.interpolate(pos.permute(0, 3, 1, 2).float(), size=x.shape[1:3], mode="bicubic",
                                align_corners=False, antialias=True).to(pos.dtype).permute(0, 2, 3, 1)
        x = x + pos
        for block in self.blocks:
            x = block(x)
        return self.net_3(self.net_2(self.neck(x.permute(0, 3, 1, 2))))


# ----------------------------------------------------------------------------- CLIP-L
class ClipAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv_proj, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv_proj(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class ClipMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))  # quick_gelu


class ClipLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps=1e-5), nn.LayerNorm(dim, eps=1e-5)
        self.self_attn, self.mlp = ClipAttention(dim, heads), ClipMlp(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    """CLIP-L whose patch embeddings are SAM's output; its own patch conv is kept only for the keys."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        dim, grid = cfg.clip_width, cfg.clip_image_size // cfg.clip_patch_size
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.zeros(dim))
        self.embeddings.patch_embedding = nn.Conv2d(3, dim, cfg.clip_patch_size, cfg.clip_patch_size, bias=False)
        self.embeddings.position_embedding = nn.Embedding(grid * grid + 1, dim)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=1e-5)  # sic: the checkpoint's spelling
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(ClipLayer(dim, cfg.clip_heads) for _ in range(cfg.clip_layers))

    def forward(self, sam_features: Tensor) -> Tensor:  # [B,C,h,w] -> [B,1+h*w,C]
        B, C, h, w = sam_features.shape
        x = sam_features.flatten(2).transpose(1, 2)
        x = torch.cat([self.embeddings.class_embedding.expand(B, 1, C), x], dim=1)
        table = self.embeddings.position_embedding.weight
        src, tgt = math.isqrt(table.shape[0] - 1), math.isqrt(x.shape[1])
        if src != tgt:
            grid = table[1:].view(1, src, src, C).permute(0, 3, 1, 2).float()
            grid = F.interpolate(grid, size=(tgt, tgt), mode="bicubic", antialias=True, align_corners=False)
            table = torch.cat([table[:1], grid.to(table.dtype).permute(0, 2, 3, 1).reshape(tgt * tgt, C)])
        x = self.pre_layrnorm(x + table)
        for layer in self.transformer.layers:
            x = layer(x)
        return x  # no post-LayerNorm


# ----------------------------------------------------------------------------- DeepEncoder
class DeepEncoder(nn.Module):
    """The vision side: `sam_model`, `vision_model` and `projector.layers`, as in the checkpoint."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.sam_model, self.vision_model = SamEncoder(cfg), ClipEncoder(cfg)
        self.projector = nn.Module()
        self.projector.layers = nn.Linear(cfg.projector_input_dim, cfg.projector_dim)

    def towers(self, pixels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Normalised views [B,3,S,S] -> (sam [B,C,g,g], clip [B,1+g*g,C], features [B,g*g,D])."""
        sam = self.sam_model(pixels)
        clip = self.vision_model(sam)
        fused = torch.cat([clip[:, 1:], sam.flatten(2).transpose(1, 2)], dim=-1)  # [CLIP, SAM]
        return sam, clip, self.projector.layers(fused)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.towers(pixels)[2]

    @torch.inference_mode()
    def encode_images(self, images: list[Image.Image], mode: str) -> Tensor:
        """Many pages in one forward -> features [B, g*g, D] (float32 on the model's device)."""
        return self.encode_pixels(views_to_tensor([make_view(im, mode) for im in images]))

    @torch.inference_mode()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """Views already made into pixels [B,3,S,S] (views_to_tensor, on any device) -> encode_images' features."""
        p = next(self.parameters())
        return self(pixels.to(p.device, p.dtype)).float()
