"""GPU speed of the full-size DeepSeek-OCR architecture, in one run of at most ~5 minutes on one H200.

    python bench/gpu.py                 # CUDA, bf16, bench/deepseek-ocr-config.json, random weights
    python bench/gpu.py --tiny          # the same script on the CPU with the nano config (~1 minute or less)

Builds the architecture from the real config.json (a copy ships as bench/deepseek-ocr-config.json: 3.3 B
parameters) with random weights made on the device (nothing is downloaded), then measures:
  * encode: pages/s through the DeepEncoder towers (SAM-B, CLIP-L, projector) in base mode (1024 x 1024
    views, 256 tokens) at batches 1, 8, 32; the views are made on the device (no image decoding);
  * decode: for 1, 16, 64, 128 concurrent sequences of fixed length (a 280-position prompt like an
    image's, then 128 tokens; no EOS, no repetition rule): the batched prefill's seconds, tokens/s,
    time per output token p50/p99 (one step gives every sequence one token), peak memory; eager and
    with every step shape captured as a CUDA graph, in the same run, and whether both gave the same
    tokens;
  * peak memory of the whole run.
Prints progress on stderr and one JSON line on stdout. A section that would run past --budget-s is
skipped and named in "skipped".
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import build_modules  # noqa: E402
from decoder import Generator, RMSNorm, grouped_mm_works  # noqa: E402
from encoder import LayerNorm2d  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@torch.no_grad()
def random_model(cfg: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The architecture of `cfg` with N(0, 0.02) matrices and unit norms, allocated and filled on the
    device at `dtype` (checkpoint.init_weights draws on the CPU: minutes for 3.3 B parameters)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # modules are built on the meta device at the target dtype, then allocated once
    try:
        encoder, decoder = build_modules(cfg, "meta")
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device).manual_seed(seed)
    for module in (encoder, decoder):
        module.to_empty(device=device)
        for name, p in module.named_parameters():
            p.zero_() if name.endswith(".bias") else p.normal_(0.0, 0.02, generator=gen)
        for m in module.modules():
            if isinstance(m, (torch.nn.LayerNorm, LayerNorm2d, RMSNorm)):
                m.weight.fill_(1.0)
    return encoder.eval(), decoder.eval()


@torch.inference_mode()
def bench_encode(encoder, batches: list[int], device, dtype, iters: int) -> dict:
    size = encoder.sam_model.pos_embed.shape[1] * 16  # the view side the config was built for (1024: base mode)
    out = {}
    for b in batches:
        pixels = torch.rand(b, 3, size, size, device=device, dtype=dtype) * 2 - 1
        encoder.towers(pixels)  # warm-up (kernel selection, allocator)
        sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            feats = encoder.towers(pixels)[2]
        sync(device)
        s = (time.perf_counter() - t) / iters
        out[str(b)] = {"pages_per_s": b / s, "s_per_batch": s, "tokens_per_page": feats.shape[1]}
        log(f"encode batch {b:3d}: {b / s:8.2f} pages/s ({s * 1e3:.1f} ms a batch)")
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


@torch.inference_mode()
def bench_decode(decoder, c: int, prompt_len: int, new_tokens: int, graphs: bool, device, seed: int) -> dict:
    """c sequences of prompt_len random embeddings, prefilled together, then new_tokens each."""
    slot = 1 << (prompt_len + new_tokens - 1).bit_length()  # a power of two: the steps' length bucket fits
    gen = Generator(decoder, c, eos_id=-1, rule=None, kv_tokens=c * slot, buckets=True, cuda_graphs=graphs)
    g = torch.Generator(device).manual_seed(seed)
    prompts = [torch.randn(prompt_len, decoder.cfg.hidden_size, generator=g, device=device,
                           dtype=decoder.embed_tokens.weight.dtype) for _ in range(c)]
    reset_peak(device)
    sync(device)
    t = time.perf_counter()
    seqs = gen.add(prompts, [new_tokens] * c)
    sync(device)
    prefill_s = time.perf_counter() - t
    warm, times = 2, []  # the first steps capture the graph of this shape (or warm the eager kernels)
    t0 = time.perf_counter()
    for _ in range(warm):
        gen.step()
    first_s = time.perf_counter() - t0
    while any(s.finish_reason is None for s in seqs):
        t = time.perf_counter()
        gen.step()  # ends with the step's copy of the new tokens to the host: a synchronisation
        times.append(time.perf_counter() - t)
    total = sum(times)
    out = {"prefill_s": prefill_s, "tokens_per_s": c * len(times) / total, "steps_timed": len(times),
           "tpot_ms_p50": 1e3 * statistics.median(times), "tpot_ms_p99": 1e3 * percentile(times, 99),
           "first_steps_s": first_s, "peak_gb": peak_gb(device), "kv_gb": 2 * gen.cache.k.nbytes / 2**30,
           "shapes": sorted(gen._graphs) if graphs else None}
    log(f"decode {'graph' if graphs else 'eager'} concurrency {c:3d}: {out['tokens_per_s']:9.1f} tokens/s, "
        f"per token p50 {out['tpot_ms_p50']:.2f} ms p99 {out['tpot_ms_p99']:.2f} ms, prefill {prefill_s:.3f} s, "
        f"peak {out['peak_gb']:.1f} GB")
    return out, [s.tokens for s in seqs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, the nano config, small sizes: a check that the script runs")
    ap.add_argument("--config", help="config.json (default: bench/deepseek-ocr-config.json; --tiny: weights/nano)")
    ap.add_argument("--device", help="default cuda (--tiny: cpu)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 (--tiny: float32)")
    ap.add_argument("--encode-batches", help="default 1,8,32 (--tiny: 1,2)")
    ap.add_argument("--concurrency", help="default 1,16,64,128 (--tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, help="default 280 (--tiny: 64)")
    ap.add_argument("--new-tokens", type=int, help="default 128 (--tiny: 16)")
    ap.add_argument("--encode-iters", type=int, help="default 5 (--tiny: 1)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip what would start after this many seconds")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args(argv)
    tiny = args.tiny
    pick = lambda value, full, small: value if value is not None else (small if tiny else full)
    config = Path(pick(args.config, ROOT / "bench" / "deepseek-ocr-config.json", ROOT / "weights" / "nano" / "config.json"))
    device = torch.device(pick(args.device, "cuda", "cpu"))
    dtype = DTYPES[pick(args.dtype, "bf16", "float32")]
    batches = [int(x) for x in pick(args.encode_batches, "1,8,32", "1,2").split(",")]
    levels = [int(x) for x in pick(args.concurrency, "1,16,64,128", "1,4").split(",")]
    prompt_len, new_tokens = pick(args.prompt_len, 280, 64), pick(args.new_tokens, 128, 16)
    iters = pick(args.encode_iters, 5, 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"no CUDA device (torch {torch.__version__}); --tiny runs on the CPU")
    start = time.perf_counter()
    over = lambda: time.perf_counter() - start > args.budget_s
    cfg = json.loads(config.read_text())
    encoder, decoder = random_model(cfg, device, dtype)
    sync(device)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for m in (encoder, decoder) for p in m.parameters())
    log(f"{config}: {params / 1e9:.3f} B parameters at {dtype} on {device}, built in {build_s:.1f} s")
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
              "params": params, "build_s": build_s, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "moe_decode": "grouped_mm" if grouped_mm_works(device, dtype) else "gathered/dense",
              "encode": {}, "decode": {"eager": {}, "cuda_graph": {} if device.type == "cuda" else None},
              "graph_tokens_equal_eager": {} if device.type == "cuda" else None, "skipped": []}
    reset_peak(device)
    result["encode"] = bench_encode(encoder, batches, device, dtype, iters)
    result["encode_peak_gb"] = peak_gb(device)
    del encoder
    for c in levels:
        tokens = {}
        for mode in ("eager", "cuda_graph") if device.type == "cuda" else ("eager",):
            if over():
                result["skipped"].append(f"decode {mode} {c}")
                continue
            try:
                result["decode"][mode][str(c)], tokens[mode] = bench_decode(decoder, c, prompt_len, new_tokens,
                                                                             mode == "cuda_graph", device, seed=c)
            except Exception as e:  # noqa: BLE001 - on a first GPU, one failing mode must not hide the others
                log(f"decode {mode} concurrency {c} failed: {type(e).__name__}: {e}")
                result["decode"][mode][str(c)] = {"error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if len(tokens) == 2:
            result["graph_tokens_equal_eager"][str(c)] = tokens["eager"] == tokens["cuda_graph"]
    result["peak_gb"] = max([result["encode_peak_gb"]] + [d["peak_gb"] for m in result["decode"].values() if m
                                                         for d in m.values() if "peak_gb" in d])
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result))


if __name__ == "__main__":
    main()
