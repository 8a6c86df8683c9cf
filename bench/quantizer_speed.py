"""How fast `train.py quantizer` trains a quantizer for a frozen base: feature caching pages/s, seconds a step
and peak memory at each batch, the largest batch that fits found by trying the next on running out of memory.

    python bench/quantizer_speed.py --base CKPT --work DIR                     # CUDA, bf16, 30 steps at 8, then 32 or 16
    python bench/quantizer_speed.py --base weights/nano --work /tmp/q --device cpu --dtype fp32 --steps 2 \\
        --cache-pages 4 --batches 2 --largest 4,3

First the base's tower features of --cache-pages rendered training pages are encoded once into DIR/features
(what the trainer's cache reads; timed in-process after the base has loaded: pages/s). Then each run is the
trainer itself, in a subprocess, on that cache: --batches each, then --largest in turn until one fits (a run
that fails on CUDA's "out of memory" tries the next; another failure stops there). Validation and the final
evaluation are off (--val-pages 0 --eval-pages 0), and the trainer's record goes to DIR, not to the project's
manifest. Its sec_per_step (the loop's wall time over its steps, one save included) and peak_gpu_mem_gb are
reported per batch. A summary, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from ocr_latent.checkpoint import load_model
from ocr_latent.training import features

CACHE_SEED = 1000  # the trainer's default --cache-seed: the shards it looks for


def cache_features(args) -> dict:
    t = time.perf_counter()
    model = load_model(args.base, args.dtype, args.device)
    load_s, t = time.perf_counter() - t, time.perf_counter()
    features.build(model, args.cache_pages, CACHE_SEED, args.work / "features")
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    print(f"feature cache: {args.cache_pages} pages in {s:.1f} s, {args.cache_pages / s:.2f} pages/s "
          f"(the base loaded in {load_s:.1f} s)", file=sys.stderr, flush=True)
    return {"pages": args.cache_pages, "seconds": s, "pages_per_s": args.cache_pages / s, "load_s": load_s}


def train(args, batch: int) -> dict:
    run = args.work / f"batch-{batch}"
    argv = [sys.executable, "train.py", "quantizer", "--base", str(args.base), "--device", args.device,
            "--dtype", args.dtype, "--steps", str(args.steps), "--batch", str(batch), "--cache-pages", str(args.cache_pages),
            "--cache-dir", str(args.work / "features"), "--run", str(run / "run"), "--out", str(run / "quantizer.safetensors"),
            "--manifest", str(run / "manifest.json"), "--val-pages", "0", "--eval-pages", "0",
            "--eval-every", str(10**9), "--save-every", str(args.steps)]
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    (args.work / f"batch-{batch}.log").write_text(proc.stdout + proc.stderr)
    out = {"batch": batch, "wall_s": time.perf_counter() - t, "rc": proc.returncode}
    if proc.returncode != 0:
        out["out_of_memory"] = "out of memory" in proc.stderr.lower()
        out["error"] = proc.stderr.strip().splitlines()[-1][:500] if proc.stderr.strip() else f"exit {proc.returncode}"
        print(f"batch {batch}: failed ({out['error']})", file=sys.stderr, flush=True)
        return out
    record = json.loads((run / "manifest.json").read_text())["artifacts"][f"{run.name}/quantizer"]
    out.update(steps=record["steps"], sec_per_step=record["sec_per_step"], peak_gpu_mem_gb=record["peak_gpu_mem_gb"],
               pages_per_s=batch / record["sec_per_step"])
    peak = f", peak GPU memory {out['peak_gpu_mem_gb']} GiB" if out["peak_gpu_mem_gb"] is not None else ""
    print(f"batch {batch}: {out['sec_per_step']:.3f} s a step ({out['pages_per_s']:.1f} pages/s){peak}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="original-layout checkpoint (train.py quantizer --base)")
    ap.add_argument("--work", type=Path, required=True, help="where the cache, the runs and their logs go")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cache-pages", type=int, default=64)
    ap.add_argument("--batches", default="8", help="batches each run")
    ap.add_argument("--largest", default="32,16", help="then these in turn until one fits")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"base": str(args.base), "device": args.device, "dtype": args.dtype, "steps": args.steps,
              "feature_cache": cache_features(args), "runs": []}
    for batch in [int(b) for b in args.batches.split(",") if b]:
        result["runs"].append(train(args, batch))
    for batch in [int(b) for b in args.largest.split(",") if b]:
        result["runs"].append(run := train(args, batch))
        if run["rc"] == 0:
            result["largest_batch"] = batch
            break
        if not run["out_of_memory"]:
            break
    print(json.dumps(result))
    sys.exit(0 if all(r["rc"] == 0 or r.get("out_of_memory") for r in result["runs"]) else 1)


if __name__ == "__main__":
    main()
