"""What the base's training (train.py) and the quantizer's (quantizer_trainer.py) share: the device they train
on, a base's code geometry and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from ocr_latent.architecture import NUM_CODES
from ocr_latent.checkpoint import OCRModel
from ocr_latent.encoder import MODES
from ocr_latent.quantizer import FSQ


def training_device(name: str) -> torch.device:
    """--device NAME as a torch device, or the reason it cannot train here (a CPU build of torch asked for cuda)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name}: give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: this torch sees no CUDA GPU; train with --device cpu, or install a CUDA build of torch")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: training runs on cpu or cuda")
    return device


def code_geometry(model: OCRModel, mode: str, levels: int) -> tuple[int, int, list[int]]:
    """This base's code geometry: (embedding width, tokens: one per 64x64 pixels of the mode's view,
    the levels of each of the NUM_CODES // tokens dimensions a token gets)."""
    tokens = (MODES[mode][0] // 64) ** 2
    return model.decoder.cfg.hidden_size, tokens, [levels] * (NUM_CODES // tokens)


def code_fsq(model: OCRModel, mode: str, levels: int, hidden: int = 0):
    """A per-token FSQ with this base's code geometry."""
    return FSQ(*code_geometry(model, mode, levels), hidden)


def cosine_to_tenth(frac: float) -> float:
    """Learning-rate factor: cosine from 1 to 0.1 as `frac` goes from 0 to 1."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
