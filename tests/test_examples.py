"""The sample inputs in examples/ are read by the embedded default, through the codes."""
from pathlib import Path

import torch
from PIL import Image

from conftest import ROOT
from ocr_latent.serving.documents import render_pdf
from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.evaluation import read_pages
from ocr_latent.training.reading_metrics import cer

EXAMPLES = ROOT / "examples"


def read_through_codes(pipe, images) -> list[str]:
    codes = pipe.encode(images)
    assert codes.shape == (len(images), 4096) and codes.min() >= 0 and codes.max() <= 15
    with torch.inference_mode():
        feats = pipe.quantizer.decode(torch.as_tensor(codes, dtype=torch.long))
    d = pipe.model.decoder
    return read_pages(pipe.model, [d.layout_image(f.to(d.lm_head.weight.dtype)) for f in feats], 512, pipe.prefill_decoder)


def test_the_examples_read_back_through_the_codes():
    pipe = load_pipeline()
    pdf = [image for _, image in render_pdf((EXAMPLES / "two-pages.pdf").read_bytes(), pipe.mode)]
    texts = read_through_codes(pipe, [Image.open(EXAMPLES / "page.png"), *pdf])
    truth = [(EXAMPLES / "page.txt").read_text().strip(), *(EXAMPLES / "two-pages.txt").read_text().strip().split("\f")]
    assert len(pdf) == 2 and len(truth) == 3
    errors = [cer(t, r) for t, r in zip(texts, truth)]
    assert max(errors) < 0.1, list(zip(errors, texts))
