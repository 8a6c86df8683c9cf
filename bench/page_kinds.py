"""What the default model reads, by kind of page: CER uncompressed and through the 4096 codes.

  python bench/page_kinds.py                      # the embedded default, 16 held-out pages of each kind
  python bench/page_kinds.py --pages 64 --kinds ordinary,letter
  python bench/page_kinds.py --base DIR --quantizer Q.safetensors

Every page is rendered from the test documents (never trained on) with the kind's geometry, read
as the service reads it (towers, quantizer, greedy decoding with the repetition rule), and scored
against its text. Prints one row a kind, then one JSON line; all figures come from this one run.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch

from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.evaluation import read_as_served
from ocr_latent.training.pages import ORDINARY, PageSpec, test_pages, toward_ordinary
from ocr_latent.training.reading_metrics import cer

CLEAN = {"augment": False}
KINDS = {  # name -> (what it is, its page spec)
    "small": ("512x512, 3-6 lines of 20-30 characters at 22-30 px (nano v1's training pages)", PageSpec(**CLEAN)),
    "small-9-lines": ("512x512, 9 lines at 22-30 px", PageSpec(min_lines=9, max_lines=9, min_line_spacing=1.1,
                                                                max_line_spacing=1.2, min_font_size=22, **CLEAN)),
    "small-16px": ("512x512, 3-6 lines at 16 px", PageSpec(min_font_size=16, max_font_size=16, **CLEAN)),
    "large-print": ("1024x1024 or letter/A4, 4-12 lines of up to 30 characters at 40-56 px (nano v4's level 0)",
                    replace(toward_ordinary(0).specs[0], **CLEAN)),
    "ordinary": ("1024x1024, 15 lines of ~40 characters at 28 px", PageSpec(
        size=1024, min_lines=15, max_lines=15, min_chars_per_line=38, max_chars_per_line=42, min_font_size=28,
        max_font_size=28, min_margin=40, max_margin=100, min_line_spacing=1.3, max_line_spacing=1.5, **CLEAN)),
    "letter": ("816x1056 letter page, 12-20 lines of 50-65 characters at 20-24 px", PageSpec(
        size=1056, shapes=((816, 1056),), min_lines=12, max_lines=20, min_chars_per_line=50, max_chars_per_line=65,
        min_font_size=20, max_font_size=24, min_margin=60, max_margin=96, **CLEAN)),
    "dense": ("1024x1024, 25 lines of ~60 characters at 18-20 px", PageSpec(
        size=1024, min_lines=25, max_lines=25, min_chars_per_line=58, max_chars_per_line=62, min_font_size=18,
        max_font_size=20, min_margin=24, max_margin=48, min_line_spacing=1.2, max_line_spacing=1.3, **CLEAN)),
    "screenshot": ("1280x800, 30 lines of ~80 characters at 13 px", PageSpec(
        size=1280, shapes=((1280, 800),), min_lines=30, max_lines=30, min_chars_per_line=78, max_chars_per_line=82,
        min_font_size=13, max_font_size=13, min_margin=16, max_margin=32, min_line_spacing=1.25,
        max_line_spacing=1.35, fonts=("DejaVuSans.ttf",), **CLEAN)),
    "latin1": ("1024x1024 ordinary page, a third of its words with Latin-1 letters (é, ü, ß, ñ ...)", PageSpec(
        **{**vars(ORDINARY), "latin1_page_prob": 1.0, "latin1_word_prob": 0.33, "augment": False,
           "max_rotation": 0.0, "shade_prob": 0.0})),
    "photo": ("ordinary pages as photographed: tint, rotation, shading, blur, noise, JPEG (nano v2's test pages)", ORDINARY),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="original-layout checkpoint directory (default: the embedded nano)")
    ap.add_argument("--quantizer")
    ap.add_argument("--pages", type=int, default=16, help="held-out pages of each kind")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.base, args.quantizer) if args.base else load_pipeline()
    print(f"model {pipe.model.name}, {args.pages} held-out pages a kind; CER: edit distance / reference characters")
    print(f"{'kind':<14} {'chars':>6} {'uncompressed':>12} {'codes':>7}  {'s/page':>6}  what")
    results = {}
    for name in args.kinds.split(","):
        what, spec = KINDS[name]
        pages = [p for p in test_pages(args.pages, seed=args.seed, spec=spec)]
        t0 = time.time()
        images = [p.image for p in pages]
        plain, coded = (read_as_served(pipe, images, codes, args.max_tokens) for codes in (False, True))
        row = {"pages": len(pages), "chars": round(float(np.mean([len(p.text) for p in pages]))),
               "cer_uncompressed": round(float(np.mean([cer(h, p.text) for h, p in zip(plain, pages)])), 4),
               "cer_codes": round(float(np.mean([cer(h, p.text) for h, p in zip(coded, pages)])), 4)}
        results[name] = row
        print(f"{name:<14} {row['chars']:>6} {row['cer_uncompressed']:>12.3f} {row['cer_codes']:>7.3f}  "
              f"{(time.time() - t0) / len(pages):>6.1f}  {what}", flush=True)
    print(json.dumps({"model": pipe.model.name, "pages_per_kind": args.pages, "kinds": results}))


if __name__ == "__main__":
    main()
