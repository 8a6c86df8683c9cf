"""Fitting how far to trust readings and codes (serving/confidence.py) on held-out pages of every kind.

    python train.py confidence                            # the embedded nano and its quantizer
    python train.py confidence --base DIR --quantizer Q   # a real checkpoint: its pages rendered here
    python train.py confidence --base DIR --quantizer Q --images scans/   # your own pages (transcripts x.txt
                                                          # beside x.png, else the reading of the page uncompressed)

Each page is read as the service reads it (the pipeline's towers, its codes, a generator with its repetition
rule and prefill precision), through the codes and uncompressed. Confidence is fitted to tell readings of
CER <= 0.25 against the transcript; fidelity to tell pages whose reading through the codes is within CER 0.1
of the uncompressed reading (no transcript needed). Pages come from the validation split's documents
(bench/confidence.py reports on the test split's); blank pages and pictures without text are read as nothing.
Writes `<quantizer>.confidence.json` beside the quantizer (or --out), which the server then loads.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from ocr_latent.serving.confidence import (FEATURES, Calibration, calibration_path, code_logfreq, fit_logistic,
                                           reading_features)
from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.pages import REPORTED_KINDS, PageStream, load_corpus, split_documents
from ocr_latent.training.reading_metrics import cer

NO_TEXT = ("blank", "picture")  # kinds without text: the faithful reading is nothing


@dataclass
class Reading:
    text: str
    logprobs: list[float]
    finish_reason: str
    codes: np.ndarray
    lost: float


def documents(half: int) -> list:
    """The documents pages are rendered from: the validation split's for the calibration (`half` 0), the test
    split's for reports (1). Neither was trained on, and no document is in both."""
    return split_documents(load_corpus())["val" if half == 0 else "test"]


def no_text_page(kind: str, seed: int) -> Image.Image:
    """A blank page (white, a faint scanner tint) or a picture without text (shapes and gradients)."""
    rng = random.Random(f"{kind}:{seed}")
    size = rng.choice([(1024, 1024), (816, 1056), (512, 512)])
    tint = tuple(255 - rng.randrange(0, 12) for _ in range(3))
    image = Image.new("RGB", size, tint)
    if kind == "picture":
        draw = ImageDraw.Draw(image)
        for _ in range(rng.randrange(4, 14)):
            box = sorted(rng.randrange(0, size[0]) for _ in range(2)), sorted(rng.randrange(0, size[1]) for _ in range(2))
            shape = (box[0][0], box[1][0], box[0][1] + 8, box[1][1] + 8)
            colour = tuple(rng.randrange(0, 256) for _ in range(3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(shape, fill=colour)
    return image


def calibration_pages(per_kind: int, half: int, seed: int, kinds: list[str]) -> list[tuple[str, Image.Image, str]]:
    """(kind, image, transcript) for `per_kind` pages of each kind, from the documents of `half`."""
    docs, out = documents(half), []
    for kind in kinds:
        if kind in NO_TEXT:
            out += [(kind, no_text_page(kind, seed * 1000 + half * 500 + i), "") for i in range(per_kind)]
            continue
        stream, index, taken = PageStream(docs, REPORTED_KINDS[kind][1], seed=seed * 10 + half), 0, 0
        while taken < per_kind:
            try:
                page = stream[index]
            except ValueError:  # a document whose text does not fit this kind's page: the next draw
                page = None
            index += 1
            if page is not None:
                out.append((kind, page.image, page.text))
                taken += 1
    return out


@torch.inference_mode()
def read(pipe, images: list[Image.Image], max_tokens: int, through_codes: bool = True, batch: int = 16) -> list[Reading]:
    """Pages read as the service reads them, with what the confidence is computed from."""
    out: list[Reading] = []
    d = pipe.model.decoder
    for i in range(0, len(images), batch):
        feats = pipe.model.encoder.encode_images(images[i:i + batch], pipe.mode)  # once: both readings start here
        codes, lost = pipe.measure(feats)
        if through_codes:
            inputs = [pipe.decode_inputs(c, "free") for c in codes]
        else:
            inputs = [d.build_inputs(d.layout_image(f.to(d.lm_head.weight.dtype)), pipe.prompts["free"],
                                     pipe.model.tokens.bos) for f in feats]
        gen = pipe.new_generator(len(inputs))
        seqs = gen.add(inputs, [max_tokens] * len(inputs))
        while any(s.finish_reason is None for s in seqs):
            gen.step()
        out += [Reading(pipe.text(s.tokens), gen.token_logprobs(s), s.finish_reason, c, float(l))
                for s, c, l in zip(seqs, codes, lost)]
    return out


def fit(pipe, readings: list[Reading], plain: list[str], truths: list[str | None]) -> Calibration:
    """The calibration of `pipe`'s quantizer from readings through the codes, the uncompressed readings, and the
    transcripts (None: judged against the uncompressed reading)."""
    q = pipe.quantizer
    table = code_logfreq(np.stack([r.codes for r in readings]), q.dims, 16)
    draft = Calibration(pipe.quantizer_fingerprint, [0.0] * len(FEATURES), 0.0, 0.0, 0.0, table.tolist())
    x = np.stack([reading_features(r.logprobs, r.finish_reason, draft.typicality(r.codes)) for r in readings])
    cers = np.array([cer(r.text, t if t is not None else p) for r, p, t in zip(readings, plain, truths)])
    weights, bias = fit_confidence(x, cers)
    drift = np.array([cer(r.text, p) for r, p in zip(readings, plain)])
    lost = np.log10(np.maximum([r.lost for r in readings], 1e-9))[:, None]
    (a,), b = fit_logistic(lost, (drift <= 0.1).astype(float)) if len(set(drift <= 0.1)) > 1 else ((-1.0,), 0.0)
    return Calibration(pipe.quantizer_fingerprint, weights.tolist(), bias, float(a), b, table.tolist(), {
        "pages": len(readings), "faithful": int((cers <= 0.25).sum()), "codes_within_0.1": int((drift <= 0.1).sum()),
        "label": "confidence: CER <= 0.25 against the transcript; fidelity: CER <= 0.1 against the uncompressed "
                 "reading"})


def fit_confidence(x: np.ndarray, cers: np.ndarray, ridge: float = 1.0) -> tuple[np.ndarray, float]:
    """Weights and bias of the confidence, sigmoid(x . w + b), in two steps: a score that ranks readings by their
    error (least squares on -log(CER + 0.05), so that worse garbage ranks lower, not only garbage below good
    readings), then its logistic calibration to P(CER <= 0.25). The result is one logistic model of the features."""
    mean, scale = x.mean(0), x.std(0) + 1e-9
    z = (x - mean) / scale
    target = -np.log(np.minimum(cers, 20.0) + 0.05)
    w = np.linalg.solve(z.T @ z + ridge * np.eye(z.shape[1]), z.T @ (target - target.mean()))
    score = z @ w
    (a,), c = fit_logistic(score[:, None], (cers <= 0.25).astype(float))
    weights = a * w / scale
    return weights, float(c - (weights * mean).sum())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", help="original-layout checkpoint directory (default: the embedded nano)")
    p.add_argument("--quantizer", help="its quantizer (default: the base's)")
    p.add_argument("--images", help="a directory of your own held-out pages (PNG/JPEG; transcripts beside as .txt)")
    p.add_argument("--per-kind", type=int, default=16, help="pages of each kind rendered here")
    p.add_argument("--kinds", default=",".join([*REPORTED_KINDS, *NO_TEXT]))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="where to write the calibration (default: beside the quantizer)")


def calibrate(args: argparse.Namespace) -> None:
    pipe = load_pipeline(args.base, args.quantizer) if args.base else load_pipeline()
    if args.images:
        files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        images = [Image.open(f).convert("RGB") for f in files]
        truths = [f.with_suffix(".txt").read_text().strip() if f.with_suffix(".txt").exists() else None for f in files]
    else:
        pages = calibration_pages(args.per_kind, 0, args.seed, args.kinds.split(","))
        images, truths = [im for _, im, _ in pages], [t for _, _, t in pages]
    print(f"calibrating on {len(images)} pages; reading them through the codes and uncompressed", flush=True)
    readings = read(pipe, images, args.max_tokens)
    plain = [r.text for r in read(pipe, images, args.max_tokens, through_codes=False)]
    calibration = fit(pipe, readings, plain, truths)
    calibration.fitted.update({"command": "python train.py confidence", "images": args.images, "per_kind": args.per_kind,
                               "kinds": args.kinds.split(","), "max_tokens": args.max_tokens, "seed": args.seed,
                               "documents": "the validation split's (training.confidence.documents(0))"})
    out = Path(args.out) if args.out else calibration_path(args.quantizer or default_quantizer(args.base))
    calibration.save(out)
    print(f"wrote {out}: {calibration.fitted}")


def default_quantizer(base: str | None) -> Path:
    from ocr_latent.architecture import ARCHITECTURE, ROOT
    if base is None:
        return ROOT / ARCHITECTURE["nano"]["quantizer"]
    local = Path(base) / "quantizer.safetensors"
    return local if local.exists() else ROOT / ARCHITECTURE["base_model"]["quantizer"]
