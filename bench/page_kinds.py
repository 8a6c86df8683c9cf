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

import numpy as np
import torch

from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.evaluation import read_as_served
from ocr_latent.training.pages import REPORTED_KINDS, test_pages
from ocr_latent.training.reading_metrics import cer

KINDS = REPORTED_KINDS


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
