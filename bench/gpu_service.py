"""The embedded nano service on a GPU, against the same service on the CPU, over HTTP in one run.

    .venv/bin/python bench/gpu_service.py reference DIR [--pages 32]   # on the CPU: render held-out pages
                                                       # into DIR (PNG + .txt) and read them through a CPU server
    python bench/gpu_service.py check DIR [--dtypes bf16,float32]       # on the GPU machine: the same pages
                                                       # through a server started with DEVICE=cuda, per dtype

`check` needs no fonts and no corpus (the pages travel as PNGs) and reports, for each DTYPE: seconds from
process start to /health 200; the share of the GPU's codes equal to the CPU's; the GPU's own codes read
at concurrency 1 and 16 (tokens/s, the same texts at both, CER against the truth); and the CPU's codes
read on the GPU (how many texts equal the CPU's, CER), which separates the decoder from the encoder.
The last line is the whole result as JSON (also written to --out).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from ocr_latent.client.codesfile import unpack
from ocr_latent.training.reading_metrics import cer
from throughput import start_server, stop_server


def read_all(url: str, pages: list[bytes], references: dict | None, concurrency: int, max_tokens: int) -> dict:
    """Encode every page, then decode the codes (or the reference's codes) at `concurrency`."""
    with httpx.Client(base_url=url, timeout=600) as client:
        def encode(png: bytes) -> str:
            r = client.post("/encode", json={"image": base64.b64encode(png).decode()})
            r.raise_for_status()
            return r.json()["codes_b64"]

        def decode(codes_b64: str) -> dict:
            r = client.post("/decode", json={"codes_b64": codes_b64, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(encode, pages))
        t = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(decode, references["codes"] if references else codes))
        wall = time.perf_counter() - t
    return {"codes": codes, "texts": [o["text"] for o in outs], "tokens": [o["num_tokens"] for o in outs],
            "tokens_per_s": sum(o["num_tokens"] for o in outs) / wall, "wall_s": wall}


def load_pages(folder: Path) -> tuple[list[bytes], list[str]]:
    files = sorted(folder.glob("page-*.png"))
    return [f.read_bytes() for f in files], [f.with_suffix(".txt").read_text() for f in files]


def reference(args) -> None:
    import io
    from ocr_latent.training.pages import test_pages
    args.dir.mkdir(parents=True, exist_ok=True)
    stream = test_pages(seed=args.seed)
    for i in range(args.pages):
        page, buf = stream[i], io.BytesIO()
        page.image.save(buf, "PNG")
        (args.dir / f"page-{i:03d}.png").write_bytes(buf.getvalue())
        (args.dir / f"page-{i:03d}.txt").write_text(page.text)
    pngs, truth = load_pages(args.dir)
    proc, url, startup_s, _ = start_server({"DEVICE": "cpu", "DECODE_SLOTS": "16"})
    try:
        r = read_all(url, pngs, None, 16, args.max_tokens)
    finally:
        stop_server(proc)
    ref = {"device": "cpu", "startup_s": startup_s, "max_tokens": args.max_tokens, "codes": r["codes"], "texts": r["texts"],
           "cer": float(np.mean([cer(h, t) for h, t in zip(r["texts"], truth)]))}
    (args.dir / "reference.json").write_text(json.dumps(ref) + "\n")
    print(f"{len(pngs)} pages in {args.dir}; CPU: healthy after {startup_s:.1f} s, CER {ref['cer']:.4f}")


def check(args) -> None:
    pngs, truth = load_pages(args.dir)
    ref = json.loads((args.dir / "reference.json").read_text())
    mean_cer = lambda texts: float(np.mean([cer(h, t) for h, t in zip(texts, truth)]))
    result = {"pages": len(pngs), "cpu_cer": ref["cer"], "cpu_startup_s": ref["startup_s"], "dtypes": {}}
    for dtype in args.dtypes.split(","):
        env = {"DEVICE": args.device, "DTYPE": dtype, "DECODE_SLOTS": "16"}
        try:
            proc, url, startup_s, log = start_server(env)
        except SystemExit as e:
            result["dtypes"][dtype] = {"error": str(e)[-3000:]}
            continue
        try:
            own1 = read_all(url, pngs, None, 1, ref["max_tokens"])
            own16 = read_all(url, pngs, None, 16, ref["max_tokens"])
            cpu_codes = read_all(url, pngs, ref, 16, ref["max_tokens"])
        except Exception as e:  # noqa: BLE001 - report what the server said, then go on to the next dtype
            result["dtypes"][dtype] = {"error": f"{type(e).__name__}: {e}", "log": log.read_text()[-3000:]}
            continue
        finally:
            stop_server(proc)
            if args.logs:  # the server's own log: warnings (a failed capture or compile), TORCH_LOGS output
                args.logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(log, args.logs / f"server-{dtype}.log")
        codes = lambda b64: unpack(base64.b64decode(b64))
        same_codes = np.mean([(codes(a) == codes(b)).mean() for a, b in zip(own16["codes"], ref["codes"])])
        result["dtypes"][dtype] = d = {
            "startup_s": startup_s, "codes_equal_cpu": float(same_codes),
            "tokens_per_s_c1": own1["tokens_per_s"], "tokens_per_s_c16": own16["tokens_per_s"],
            "ratio_c16_c1": own16["tokens_per_s"] / own1["tokens_per_s"],
            "texts_same_c1_c16": own1["texts"] == own16["texts"], "cer": mean_cer(own16["texts"]),
            "cpu_codes_texts_equal_cpu": sum(a == b for a, b in zip(cpu_codes["texts"], ref["texts"])),
            "cpu_codes_cer": mean_cer(cpu_codes["texts"])}
        print(f"{dtype}: healthy after {startup_s:.1f} s; codes equal to the CPU's {100 * same_codes:.1f} %; "
              f"{d['tokens_per_s_c1']:.0f} tokens/s at 1, {d['tokens_per_s_c16']:.0f} at 16; CER {d['cer']:.4f} "
              f"(CPU {ref['cer']:.4f}); the CPU's codes read as the CPU read them: {d['cpu_codes_texts_equal_cpu']}"
              f"/{len(pngs)} (CER {d['cpu_codes_cer']:.4f})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["reference", "check"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=2, help="test_pages seed (test split, no augmentation)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--dtypes", default="bf16,float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logs", type=Path, help="check: copy each server's log into this folder")
    args = ap.parse_args(argv)
    reference(args) if args.what == "reference" else check(args)


if __name__ == "__main__":
    main()
