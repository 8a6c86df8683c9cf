"""What the base's training (train.py) and the quantizer's (quantizer_trainer.py) share: a base's code
geometry and the learning-rate schedule."""
from __future__ import annotations

import math

from ocr_latent.architecture import NUM_CODES
from ocr_latent.checkpoint import OCRModel
from ocr_latent.encoder import MODES
from ocr_latent.quantizer import FSQ


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
