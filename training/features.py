"""Frozen-tower features of rendered training pages, encoded once and kept on disk in shards.

A quantizer trained on a frozen base sees the same towers' output for a page on every pass, so the
towers (2/3 of a CPU training step) run once per page. Shards of `SHARD` pages are written as they
are made: an interrupted build resumes at the first missing shard, and training can start on the
shards already there. Each shard names the base (fingerprint), the page stream (seed) and its first
page, so a cache is never read for towers or pages it was not made from.

  python -m ocr_latent.training.features --base runs/frozen-base --out runs/cache-q --pages 16384 --seed 1000
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ocr_latent.checkpoint import OCRModel, load_model
from ocr_latent.training.evaluation import rendered
from ocr_latent.training.pages import PAGE_KINDS, PageStream, training_documents
from ocr_latent.training.recipe import training_device

SHARD = 512


def shard_path(out: Path, index: int) -> Path:
    return out / f"features-{index:05d}.safetensors"


def shard_size(pages: int) -> int:
    """Pages per shard: SHARD, or all of a smaller cache in one."""
    return min(SHARD, pages)


def shard_key(model: OCRModel, seed: int, index: int, size: int, kind: str = "small", more_text: bool = False) -> dict[str, str]:
    from ocr_latent.serving.pipeline import base_fingerprint
    key = {"base_fingerprint": base_fingerprint(model), "stream_seed": str(seed), "first_page": str(index * size),
           "pages": str(size)}
    key = key if kind == "small" else key | {"page_kind": kind}  # caches of small pages predate the field
    return key | {"documents": "train+train-only"} if more_text else key


def shard_is_for(path: Path, key: dict[str, str]) -> bool:
    if not path.exists() or not path.with_suffix(".json").exists():
        return False
    with safe_open(str(path), "pt") as f:
        made_for = f.metadata() or {}
    # the same fields both ways: a shard with a field the key lacks (more documents) is not one without it
    return made_for == key


@torch.inference_mode()
def build(model: OCRModel, pages: int, seed: int, out: Path, batch: int = 16, kind: str = "small", more_text: bool = False,
          workers: int = 0) -> None:
    """Encode pages [0, pages) of the train split's stream `seed` of page kind `kind` (pages.PAGE_KINDS),
    rounded up to whole shards; shards already there for this base and stream are kept. `more_text`: the
    pages' text is drawn from the train-only documents too (pages.train_only_documents). `workers`: processes
    rendering the pages (evaluation.Renderers), else one thread."""
    documents = training_documents(more_text)
    mode = model.config.get("ocr_latent", {}).get("mode", "base")
    out.mkdir(parents=True, exist_ok=True)
    size = shard_size(pages)
    todo = [i for i in range(-(-pages // size)) if not shard_is_for(shard_path(out, i), shard_key(model, seed, i, size, kind, more_text))]
    if not todo:
        return
    bar = tqdm(total=len(todo) * size, desc="feature cache", dynamic_ncols=True)
    chunks = [(i, list(range(j, min(j + batch, (i + 1) * size)))) for i in todo for j in range(i * size, (i + 1) * size, batch)]
    feats, texts = [], []
    for n, (chunk, pixels) in enumerate(rendered(PAGE_KINDS[kind], seed, [c for _, c in chunks], mode, documents, workers)):
        feats.append(model.encoder.encode_pixels(pixels).to("cpu", torch.bfloat16))
        texts += [p.text for p in chunk]
        bar.update(len(chunk))
        if n + 1 == len(chunks) or chunks[n + 1][0] != chunks[n][0]:  # the shard's last batch
            write_shard(model, out, chunks[n][0], size, seed, kind, more_text, feats, texts)
            feats, texts = [], []
    bar.close()


def write_shard(model: OCRModel, out: Path, i: int, size: int, seed: int, kind: str, more_text: bool,
                feats: list[torch.Tensor], texts: list[str]) -> None:
    path = shard_path(out, i)
    path.with_suffix(".json").write_text(json.dumps(texts))  # texts first: a shard counts once its tensor is there
    tmp = path.with_suffix(".tmp")
    save_file({"features": torch.cat(feats)}, str(tmp), metadata=shard_key(model, seed, i, size, kind, more_text))
    tmp.rename(path)


def load(model: OCRModel, pages: int, seed: int, out: Path, kind: str = "small",
         more_text: bool = False, workers: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Features [pages, T, D] (bf16, on the CPU) of the first `pages` pages of stream `seed`, with their texts;
    the shards that are missing, or were made for other towers or pages, are encoded first."""
    build(model, pages, seed, out, kind=kind, more_text=more_text, workers=workers)
    size, feats, texts = shard_size(pages), [], []
    for i in range(-(-pages // size)):
        feats.append(load_file(str(shard_path(out, i)))["features"])
        texts += json.loads(shard_path(out, i).with_suffix(".json").read_text())
    return torch.cat(feats)[:pages], texts[:pages]


def cells(texts: list[str], seed: int, out: Path, kind: str, more_text: bool, page_cells, placement: str) -> list[list[int]]:
    """`page_cells(page)` (losses.char_cells as a run places characters, which `placement` names) of each cached
    page, in cache order. The cache keeps only features and texts, so the pages are rendered again (a pure
    function of the stream) and the result kept beside the shards, for the same pages, texts and placement only."""
    path = out / "cells.json"
    key = {"texts_sha256": _texts_hash(texts), "page_kind": kind, "placement": placement}
    if path.exists():
        kept = json.loads(path.read_text())
        if {k: kept.get(k) for k in key} == key:
            return kept["cells"]
    stream = PageStream(training_documents(more_text), PAGE_KINDS[kind], seed=seed)
    result = []
    for i, text in enumerate(tqdm(texts, desc="character cells", dynamic_ncols=True)):
        page = stream[i]
        if page.text != text:
            raise RuntimeError(f"{out}: cached page {i} is not page {i} of its stream; delete the cache to rebuild it")
        result.append(page_cells(page))
    path.write_text(json.dumps(key | {"cells": result}))
    return result


def _texts_hash(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


def epoch_batch(pages: int, batch: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s batch over `pages` cached pages: each pass over them (epoch) in a fresh
    order of its own (seeded by seed + epoch), so a resumed run draws exactly the batches it would have."""
    span = range(step * batch, (step + 1) * batch)
    orders = {e: torch.randperm(pages, generator=torch.Generator().manual_seed(seed + e)).tolist()
              for e in {g // pages for g in span}}
    return [orders[g // pages][g % pages] for g in span]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="original-layout checkpoint directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1000, help="page stream of the train split")
    ap.add_argument("--kind", choices=sorted(PAGE_KINDS), default="small", help="page kind (pages.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=0, help="processes rendering the pages (0: one thread)")
    args = ap.parse_args(argv)
    training_device(args.device)
    torch.set_num_threads(args.threads)
    build(load_model(args.base, device=args.device), args.pages, args.seed, Path(args.out), kind=args.kind,
          workers=args.workers)


if __name__ == "__main__":
    main()
