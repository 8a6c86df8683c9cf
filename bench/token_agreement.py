"""Whether two ways of decoding read held-out pages token for token alike, on the embedded nano model.

    python bench/token_agreement.py --variant compiled --dtypes float32,bf16 --pages 32   # torch.compile'd steps
    python bench/token_agreement.py --variant device_rule --pages 256     # the n-gram ban on the device, overlapped
    python bench/token_agreement.py --variant compiled --device cuda      # on a GPU (graphs on both sides)

--pages held-out test pages (ocr_latent.training.pages, seed 2) are encoded once per dtype by the nano
pipeline, and their codes read (prompt "free", at most --max-tokens tokens, prompts at the model's dtype) in
waves of --slots by two generators: the reference and the variant.
  * compiled: eager steps (on CUDA captured as graphs), then torch.compile'd ones, compiled first as the
    service's warm-up compiles them (Generator.prepare);
  * device_rule: the host's n-gram ban (a CPU's default), then the ban inside the step with each step's
    tokens read back while the next runs (CUDA's default).
Per dtype: pages read identically, the mean common prefix, the first pages that differ, whether the finish
reasons agree, and seconds. The exit status is 1 where a dtype of --require-identical (default float32
for compiled, every dtype for device_rule) read any page otherwise. A summary, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.pages import test_pages

# the two generators of each variant: Generator options, and whether steps compile (warmed up first)
VARIANTS = {"compiled": ({}, {"compile": True}),
            "device_rule": ({"device_rule": False}, {"device_rule": True, "overlap": True})}


def read(pipe, inputs: list, options: dict, slots: int, max_tokens: int) -> tuple[list, float, float]:
    """(tokens, finish_reason) of every page in waves of `slots`, the seconds compiling took, and reading."""
    slot = 1 << (inputs[0].shape[0] + max_tokens).bit_length()
    gen = pipe.new_generator(slots, slots * slot, **options)
    t = time.perf_counter()
    if options.get("compile"):
        torch._dynamo.reset()  # compiled afresh for this model and dtype
        gen.prepare(gen.warmup_shapes())
    compile_s, t = time.perf_counter() - t, time.perf_counter()
    out = []
    for i in range(0, len(inputs), slots):
        out += [(s.tokens, s.finish_reason) for s in gen.generate(inputs[i:i + slots], [max_tokens] * len(inputs[i:i + slots]))]
    return out, compile_s, time.perf_counter() - t


def compare(reference: list, variant: list) -> dict:
    prefix = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    differ = [i for i, (a, b) in enumerate(zip(reference, variant)) if a[0] != b[0]]
    return {"pages": len(reference), "identical_pages": len(reference) - len(differ), "differ": differ[:20],
            "mean_common_prefix": statistics.mean(prefix(a[0], b[0]) for a, b in zip(reference, variant)),
            "tokens": sum(len(a[0]) for a in reference),
            "finish_reasons_equal": [a[1] for a in reference] == [b[1] for b in variant]}


def git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="compiled")
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slots", type=int, default=16, help="pages read together (a wave)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--require-identical", help="dtypes whose pages must all read alike (default: float32 for "
                    "compiled, every dtype for device_rule)")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    required = set((args.require_identical if args.require_identical is not None else
                    "float32" if args.variant == "compiled" else args.dtypes).split(","))
    stream = test_pages(seed=2)
    images = [stream[i].image for i in range(args.pages)]
    result = {"variant": args.variant, "device": args.device, "pages": args.pages, "max_tokens": args.max_tokens,
              "slots": args.slots, "commit": git_commit(), "dtypes": {}}
    for dtype in dtypes:
        pipe = load_pipeline(device=args.device, dtype=dtype, prefill_dtype=dtype)
        codes = [c for i in range(0, len(images), 16) for c in pipe.encode(images[i:i + 16])]
        inputs = [pipe.decode_inputs(c, "free") for c in codes]
        reference, variant = VARIANTS[args.variant]
        ref, _, ref_s = read(pipe, inputs, reference, args.slots, args.max_tokens)
        got, compile_s, got_s = read(pipe, inputs, variant, args.slots, args.max_tokens)
        r = result["dtypes"][dtype] = {**compare(ref, got), "reference_s": ref_s, "variant_s": got_s,
                                       "compile_s": compile_s, "must_be_identical": dtype in required}
        print(f"{args.variant} {dtype}: {r['identical_pages']}/{r['pages']} pages identical ({r['tokens']} tokens; "
              f"mean common prefix {r['mean_common_prefix']:.1f}), finish reasons equal: {r['finish_reasons_equal']}; "
              f"reference {ref_s:.1f} s, variant {got_s:.1f} s (compiling {compile_s:.1f} s)", file=sys.stderr, flush=True)
    result["ok"] = all(r["identical_pages"] == r["pages"] and r["finish_reasons_equal"]
                       for dtype, r in result["dtypes"].items() if dtype in required)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
