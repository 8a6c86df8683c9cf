"""A quantizer without transcripts: the frozen base's own uncompressed reading is the target.

Someone who brings DeepSeek-OCR has scans and PDFs, not transcripts. The quantizer's job is to make
the base read through 4,096 codes what it reads from its uncompressed features, so that reading
is the target: each page is encoded once by the frozen towers and read once, greedily, by the frozen
decoder (the project's own `Generator`, as the service reads), and both are cached. The same
comparison measures a quantizer on any held-out directory, again without transcripts:

  python train.py quantizer --targets self --data scans/ --out weights/mine/quantizer.safetensors
  python train.py report --data held-out/ --base weights/nano        # CER of the codes' reading
                                                                    # against the uncompressed one
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ocr_latent.checkpoint import OCRModel
from ocr_latent.serving.documents import page_count, render_pdf
from ocr_latent.training.evaluation import read_pages
from ocr_latent.training.reading_metrics import cer

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp")
PDF_SUFFIX = ".pdf"


def directory_pages(root: Path, mode: str) -> list[tuple[str, Callable[[], Image.Image]]]:
    """Every image file and every page of every PDF under `root` (recursively, sorted by path), as
    (name, load): `scan.png`, `report.pdf#2` (1-based). Images load lazily, so a large directory is
    not held in memory."""
    pages = []
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        name, suffix = str(path.relative_to(root)), path.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            pages.append((name, lambda path=path: Image.open(path)))
        elif suffix == PDF_SUFFIX:
            data = path.read_bytes()
            count = page_count(data)
            load = pdf_page_loader(data, mode, count)
            pages += [(f"{name}#{number}", lambda number=number, load=load: load(number)) for number in range(1, count + 1)]
    return pages


def pdf_page_loader(data: bytes, mode: str, count: int, chunk: int = 16) -> Callable[[int], Image.Image]:
    """Page `number` (1-based) of a PDF, rendered with the `chunk` - 1 pages after it and those kept until
    a page outside them is asked for: pages read in order cost one opening of the document a chunk,
    not one a page."""
    kept: dict[int, Image.Image] = {}

    def load(number: int) -> Image.Image:
        if number not in kept:
            kept.clear()
            last = min(count, number + chunk - 1)
            kept.update(render_pdf(data, mode, f"{number}-{last}", max_pages=chunk))
        return kept[number]
    return load


def transcript_of(root: Path, name: str) -> str | None:
    """The transcript beside an image (`scan.png` -> `scan.txt`), if there is one; PDF pages have none."""
    if "#" in name:
        return None
    path = (Path(root) / name).with_suffix(".txt")
    return path.read_text().strip() if path.exists() else None


def batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


@torch.inference_mode()
def own_reading(model: OCRModel, feats: torch.Tensor, max_tokens: int, batch: int = 32, quantizer=None) -> list[str]:
    """The base's greedy reading of features [N, T, D], uncompressed or through a quantizer's codes."""
    d, texts = model.decoder, []
    dtype = d.lm_head.weight.dtype
    for chunk in tqdm(list(batches(list(range(len(feats))), batch)), desc="reading", dynamic_ncols=True, leave=False):
        f = feats[chunk].to(dtype)
        if quantizer is not None:
            f = quantizer.decode(quantizer.encode(f.float())).to(dtype)
        texts += read_pages(model, [d.layout_image(x) for x in f], max_tokens)
    return texts


def cached_reading(model: OCRModel, feats: torch.Tensor, path: Path, max_tokens: int) -> list[str]:
    """`own_reading` of the features, kept in `path` (JSON) for this base and these exact features."""
    from ocr_latent.serving.pipeline import base_fingerprint
    key = {"base_fingerprint": base_fingerprint(model), "max_tokens": max_tokens, "pages": len(feats),
           "features_sha256": hashlib.sha256(feats.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["texts"]
    texts = own_reading(model, feats, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "texts": texts}))
    tmp.rename(path)
    return texts


@torch.inference_mode()
def encode_directory(model: OCRModel, root: Path, mode: str, cache: Path, batch: int = 16) -> tuple[torch.Tensor, list[str]]:
    """Frozen-tower features [N, T, D] (bf16) of every page under `root`, with the pages' names; kept in
    `cache` and reused while the base and the list of pages are the same."""
    from ocr_latent.serving.pipeline import base_fingerprint
    pages = directory_pages(root, mode)
    if not pages:
        raise SystemExit(f"--data {root}: no images ({', '.join(IMAGE_SUFFIXES)}) or PDFs in it")
    names = [name for name, _ in pages]
    key = {"base_fingerprint": base_fingerprint(model), "names_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest()}
    tensor, meta = cache / "features.safetensors", cache / "pages.json"
    if tensor.exists() and meta.exists() and json.loads(meta.read_text()).get("key") == key:
        return load_file(str(tensor))["features"], names
    feats = []
    for chunk in tqdm(list(batches(pages, batch)), desc="encoding pages", dynamic_ncols=True, leave=False):
        feats.append(model.encoder.encode_images([load() for _, load in chunk], mode).to(torch.bfloat16))
    feats = torch.cat(feats)
    cache.mkdir(parents=True, exist_ok=True)
    save_file({"features": feats}, str(cache / "features.tmp"))
    (cache / "features.tmp").rename(tensor)
    meta.write_text(json.dumps({"key": key, "names": names}, indent=1) + "\n")
    return feats, names


def agreement_report(model: OCRModel, quantizer, root: Path, mode: str, cache: Path, max_tokens: int) -> dict:
    """How closely the reading through the codes matches the uncompressed reading on every page under
    `root` (CER between the two: no transcripts needed), and each against a transcript where one lies
    beside an image."""
    feats, names = encode_directory(model, root, mode, cache)
    plain = cached_reading(model, feats, cache / "uncompressed-reading.json", max_tokens)
    coded = own_reading(model, feats, max_tokens, quantizer=quantizer)
    rows = []
    for name, p, c in zip(names, plain, coded):
        row = {"page": name, "chars_uncompressed": len(p), "cer_codes_vs_uncompressed": round(cer(c, p), 4)}
        if (truth := transcript_of(root, name)) is not None:
            row |= {"cer_uncompressed": round(cer(p, truth), 4), "cer_codes": round(cer(c, truth), 4)}
        rows.append(row)
    summary = {"pages": len(rows), "cer_codes_vs_uncompressed": round(float(np.mean([r["cer_codes_vs_uncompressed"] for r in rows])), 4),
               "identical_pages": sum(p == c for p, c in zip(plain, coded))}
    with_truth = [r for r in rows if "cer_codes" in r]
    if with_truth:
        summary |= {"pages_with_transcripts": len(with_truth),
                    "cer_uncompressed": round(float(np.mean([r["cer_uncompressed"] for r in with_truth])), 4),
                    "cer_codes": round(float(np.mean([r["cer_codes"] for r in with_truth])), 4)}
    return {"rows": rows, "summary": summary}


def report(args) -> None:
    """`train.py report`: print the agreement table of a directory, then one JSON line."""
    from ocr_latent.checkpoint import load_model
    from ocr_latent.quantizer import ScalarCodes
    model = load_model(args.base)
    model.encoder.eval(), model.decoder.eval()
    mode = model.config.get("ocr_latent", {}).get("mode", "base")
    quantizer, _ = ScalarCodes.load(args.quantizer or Path(args.base) / "quantizer.safetensors")
    quantizer.eval()
    cache = Path(args.cache_dir) if args.cache_dir else Path(args.data) / ".ocr-latent-report"
    result = agreement_report(model, quantizer, Path(args.data), mode, cache, args.max_tokens)
    width = max(len(r["page"]) for r in result["rows"])
    print(f"{'page':<{width}}  chars  CER codes vs uncompressed" + ("  CER uncompressed  CER codes"
                                                                     if "cer_codes" in result["summary"] else ""))
    for r in result["rows"]:
        print(f"{r['page']:<{width}}  {r['chars_uncompressed']:>5}  {r['cer_codes_vs_uncompressed']:>25.4f}"
              + (f"  {r['cer_uncompressed']:>16.4f}  {r['cer_codes']:>9.4f}" if "cer_codes" in r else ""))
    print(json.dumps(result["summary"]))


def add_report_arguments(r) -> None:
    r.add_argument("--data", required=True, help="a directory of page images and PDFs (transcripts optional: scan.txt beside scan.png)")
    r.add_argument("--base", default="weights/nano", help="original-layout checkpoint directory")
    r.add_argument("--quantizer", help="default: BASE/quantizer.safetensors")
    r.add_argument("--cache-dir", help="where the pages' features and uncompressed reading are kept "
                   "(default: DATA/.ocr-latent-report)")
    r.add_argument("--max-tokens", type=int, default=2048, help="longest reading of a page")
    r.add_argument("--threads", type=int, default=2)
