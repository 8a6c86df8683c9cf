"""Fidelity of reading through the codes: CER/WER uncompressed and through the 4096 codes.

  python bench/fidelity.py                      # nano + its quantizer on held-out rendered test pages
  python bench/fidelity.py --base DIR --quantizer Q.safetensors --pages-dir DIR   # IMAGE + .txt pairs
  python bench/fidelity.py --url http://127.0.0.1:8000   # the same pages through a running server

Prints what the 2,048 bytes of codes stand against (bits per character of the page text; the bytes
the text itself needs raw, gzip'd and lzma'd, one page at a time), one row per setting (CER, WER),
and the worst pages. All figures come from this one run.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import io
import json
import lzma
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ocr_latent.training.pages import PageSpec, test_pages
from ocr_latent.architecture import BITS_PER_CODE, NUM_CODES
from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.quantizer import code_usage
from ocr_latent.training.reading_metrics import cer, wer
from ocr_latent.training.evaluation import read_as_served


def pages_to_read(args) -> list[tuple[Image.Image, str]]:
    if args.pages_dir:
        files = sorted(f for f in Path(args.pages_dir).iterdir() if f.with_suffix(".txt").exists() and f.suffix != ".txt")
        return [(Image.open(f), f.with_suffix(".txt").read_text().strip()) for f in files[: args.pages]]
    stream = test_pages(seed=args.seed, spec=PageSpec(augment=args.augment))
    return [(p.image, p.text) for p in (stream[i] for i in range(args.pages))]


def text_bytes(texts: list[str]) -> dict[str, float]:
    """Mean bytes per page of the ground-truth text: raw, and compressed on its own by gzip -9 and lzma
    (raw lzma stream, no container header: the codes carry none either)."""
    raw = [t.encode() for t in texts]
    lz = lambda b: lzma.compress(b, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
    return {"raw": float(np.mean([len(b) for b in raw])), "gzip": float(np.mean([len(gzip.compress(b, 9, mtime=0)) for b in raw])),
            "lzma": float(np.mean([len(lz(b)) for b in raw]))}


def post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def via_server(url: str, pages) -> list[str]:
    out = []
    for image, _ in pages:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        codes = post(f"{url}/encode", {"image": base64.b64encode(buf.getvalue()).decode()})
        out.append(post(f"{url}/decode", {"codes_b64": codes["codes_b64"], "max_tokens": 512})["text"])
    return out


def local(pipe, pages, through_codes: bool) -> list[str]:
    return read_as_served(pipe, [im for im, _ in pages], through_codes, 512)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="original-layout checkpoint (default: embedded nano)")
    ap.add_argument("--quantizer")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--pages-dir", help="IMAGE + .txt pairs instead of rendered test pages")
    ap.add_argument("--augment", action="store_true", help="render test pages with noise/blur/JPEG")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--url", help="also read the pages through a running server")
    ap.add_argument("--worst", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-dtype", help="the prompts' precision (default: what the server uses on this CPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pages = pages_to_read(args)
    refs = [t for _, t in pages]
    pipe = load_pipeline(args.base, args.quantizer, prefill_dtype=args.prefill_dtype)
    chars = np.mean([len(t) for t in refs])
    print(f"model {pipe.label} ({pipe.model.name}), mode {pipe.mode}, prompts prefilled in {pipe.prefill_dtype}, {len(pages)} test pages, "
          f"{np.mean([len(t.splitlines()) for t in refs]):.1f} lines / {chars:.0f} characters per page on average")
    code_bytes = NUM_CODES * BITS_PER_CODE // 8
    print(f"bits of code per character: {NUM_CODES * BITS_PER_CODE / chars:.1f} ({NUM_CODES} codes x {BITS_PER_CODE} bits / {chars:.0f} characters)")
    sizes = text_bytes(refs)
    print("the page text itself, bytes per page: " + ", ".join(f"{k} {v:.0f}" for k, v in sizes.items())
          + f"; the codes: {code_bytes} = " + ", ".join(f"{code_bytes / v:.1f}x {k}" for k, v in sizes.items()))
    settings = [("uncompressed", lambda: local(pipe, pages, False)), ("through codes", lambda: local(pipe, pages, True))]
    if args.url:
        settings.append(("server " + args.url, lambda: via_server(args.url.rstrip("/"), pages)))
    results = {}
    print(f"{'setting':<28} {'CER':>7} {'WER':>7} {'exact pages':>12} {'seconds':>8}")
    for name, run in settings:
        t = time.time()
        hyps = run()
        cers = [cer(h, r) for h, r in zip(hyps, refs)]
        results[name] = (hyps, cers)
        print(f"{name:<28} {np.mean(cers):>7.4f} {np.mean([wer(h, r) for h, r in zip(hyps, refs)]):>7.4f} "
              f"{sum(c == 0 for c in cers):>6}/{len(cers):<5} {time.time() - t:>8.1f}")
    plain, coded = np.mean(results["uncompressed"][1]), np.mean(results["through codes"][1])
    codes = np.concatenate([pipe.encode([im for im, _ in pages[i:i + 16]]) for i in range(0, len(pages), 16)])
    usage = code_usage(torch.from_numpy(codes), pipe.quantizer)
    print(f"code usage on these pages: {usage['position_entropy_bits_mean']:.2f} bits of entropy per code "
          f"(of {BITS_PER_CODE}; {usage['position_entropy_bits_mean'] * NUM_CODES / 8:.0f} of {code_bytes} bytes a page), "
          f"{usage['dead_positions']} of {NUM_CODES} code positions never change, "
          f"per-dimension entropy {min(usage['dim_entropy_bits']):.2f}-{max(usage['dim_entropy_bits']):.2f} bits")
    print(f"CER through codes - uncompressed: {100 * (coded - plain):+.2f} points")
    hyps, cers = results["through codes"]
    print("worst pages through the codes:")
    for i in np.argsort(cers)[::-1][: args.worst]:
        print(f"  page {i}: CER {cers[i]:.3f}\n    truth: {refs[i]!r}\n    read:  {hyps[i]!r}")


if __name__ == "__main__":
    main()
