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
    tokens; at --compile-levels also compiled (and captured, on CUDA), and where few rows run (rows x
    top-k <= experts) three ways: projections as fused reductions and each row's experts read in place
    (the default), projections as GEMM calls ("_gemm"), and GEMM calls with grouped expert GEMMs
    ("_grouped", the code before the in-place paths);
  * time to healthy: the random model written as an original-layout checkpoint (safetensors, config.json,
    nano's special tokens and a tokenizer of the whole vocabulary) with a quantizer made for it, then a
    fresh process timed from its start until its engine is ready (weights read and moved to the device,
    one warm-up encode and decode);
  * the step timeline: at --timeline-rows (128) sequences with the service's repetition rule, what a step
    spends in the model's forward, in the host's work on its tokens (the rule, each row's choice, the
    bookkeeping) and in detokenising each row's streamed text, separately (synchronised), then the
    step as the engine meets it (unsynchronised);
  * peak memory of the whole run.
`--write-checkpoint DIR` only writes the random model as that checkpoint, with its quantizer, to DIR (what
bench/gpu_suite.sh serves and trains a quantizer on) and prints its JSON.
Prints progress on stderr and one JSON line on stdout (also written to --out after each section, so a
run stopped early keeps what it measured). A section that would run past --budget-s is skipped and
named in "skipped". --profile FILE adds torch.profiler tables of a few decode steps at each level.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from ocr_latent.checkpoint import OCRModel, SpecialTokens, build_modules, save_model
from ocr_latent.decoder import Linear, MoE, RMSNorm, grouped_mm_works, set_deterministic
from ocr_latent.generation import Generator
from ocr_latent.encoder import LayerNorm2d

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32}


# the compiled variants of few-row steps: (Linear.in_place, MoE.in_place) by mode suffix (none: both in place)
IN_PLACE = {"gemm": (False, True), "grouped": (False, False)}


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
def bench_decode(decoder, c: int, prompt_len: int, new_tokens: int, graphs: bool, device, seed: int,
                 profile: Path | None = None, compile: bool = False, label: str = "", alone: bool = False,
                 in_place: tuple[bool, bool] = (True, True)) -> tuple[dict, list]:
    """c sequences of prompt_len random embeddings, prefilled together, then new_tokens each (`alone`: only
    the first of them, in the same c slots). With `profile`, the last few steps run under torch.profiler
    (untimed) and its table is appended there. `in_place`: (Linear.in_place, MoE.in_place) for this run."""
    if compile:
        torch._dynamo.reset()  # each compiled run compiles afresh: no variant inherits another's graphs or recompile count
    Linear.in_place, MoE.in_place = in_place
    try:
        return _bench_decode(decoder, c, prompt_len, new_tokens, graphs, device, seed, profile, compile, label, alone)
    finally:
        Linear.in_place = MoE.in_place = True


def _bench_decode(decoder, c, prompt_len, new_tokens, graphs, device, seed, profile, compile, label, alone):
    slot = 1 << (prompt_len + new_tokens - 1).bit_length()  # a power of two: the steps' length bucket fits
    gen = Generator(decoder, c, eos_id=-1, rule=None, kv_tokens=c * slot, buckets=True, cuda_graphs=graphs, compile=compile)
    g = torch.Generator(device).manual_seed(seed)
    prompts = [torch.randn(prompt_len, decoder.cfg.hidden_size, generator=g, device=device,
                           dtype=decoder.embed_tokens.weight.dtype) for _ in range(c)]
    reset_peak(device)
    sync(device)
    t = time.perf_counter()
    seqs = gen.add(prompts[:1] if alone else prompts, [new_tokens] * (1 if alone else c))
    sync(device)
    prefill_s = time.perf_counter() - t
    warm, times, profiled = 2, [], 4 if profile else 0  # the first steps capture the graph of this shape (or warm the eager kernels)
    t0 = time.perf_counter()
    for _ in range(warm):
        gen.step()
    first_s = time.perf_counter() - t0
    while len(seqs[0].tokens) < new_tokens - profiled:
        t = time.perf_counter()
        gen.step()  # ends with a copy of new tokens to the host (on CUDA the previous step's, while this one runs)
        times.append(time.perf_counter() - t)
    if profiled:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            while seqs[0].finish_reason is None:
                gen.step()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        with profile.open("a") as f:
            f.write(f"\n## decode {label} concurrency {c}: {profiled} steps\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70) + "\n")
    total = sum(times)
    out = {"prefill_s": prefill_s, "tokens_per_s": len(seqs) * len(times) / total, "steps_timed": len(times),
           "tpot_ms_p50": 1e3 * statistics.median(times), "tpot_ms_p99": 1e3 * percentile(times, 99),
           "first_steps_s": first_s, "peak_gb": peak_gb(device), "kv_gb": 2 * gen.cache.k.nbytes / 2**30,
           "shapes": sorted(gen._graphs) if graphs else None}
    log(f"decode {label} concurrency {c:3d}: {out['tokens_per_s']:9.1f} tokens/s, "
        f"per token p50 {out['tpot_ms_p50']:.2f} ms p99 {out['tpot_ms_p99']:.2f} ms, prefill {prefill_s:.3f} s, "
        f"peak {out['peak_gb']:.1f} GB")
    return out, [s.tokens for s in seqs]


def median_p90(xs: list[float]) -> dict:
    return {"p50": 1e3 * statistics.median(xs), "p90": 1e3 * percentile(xs, 90)}


@torch.inference_mode()
def step_timeline(decoder, rows: int, prompt_len: int, steps: int, graphs: bool, device, seed: int = 0,
                  label: str = "", **generator) -> dict:
    """Where one decode step of `rows` sequences goes, with the service's repetition rule and streamed text:
    the model's forward (Generator._run, synchronised before and after), the host's work on the new tokens
    (the rest of Generator.step: the copy back, the rule, each row's choice, the bookkeeping) and the
    detokenisation a streamed request adds (engine.TextStream.feed for each row); each ms a step (p50, p90),
    over `steps` steps. Then the same sequences again, as the engine's loop meets their steps:
    unsynchronised, step and detokenisation, ms a step: with `overlap` the host's part runs while the
    device computes the next step. `generator`: Generator's options for this run (TIMELINE_MODES)."""
    from ocr_latent.architecture import GENERATION
    from ocr_latent.generation import RepetitionRule
    from ocr_latent.serving.engine import TextStream
    tokenizer = full_vocab_tokenizer(decoder.cfg.vocab_size)
    slot = 1 << (prompt_len + steps + 4).bit_length()
    gen = Generator(decoder, rows, eos_id=-1, rule=RepetitionRule(**GENERATION["repetition"]), kv_tokens=rows * slot,
                    buckets=graphs, cuda_graphs=graphs, **generator)
    g = torch.Generator(device).manual_seed(seed)
    prompts = [torch.randn(prompt_len, decoder.cfg.hidden_size, generator=g, device=device,
                           dtype=decoder.embed_tokens.weight.dtype) for _ in range(rows)]
    run, forward, host, detok, wall, running = gen._run, [], [], [], [], []

    def timed_run(*a, **k):
        sync(device)
        t = time.perf_counter()
        out = run(*a, **k)
        sync(device)
        forward.append(time.perf_counter() - t)
        return out

    for split in (True, False):  # both passes read the same sequences over the same positions
        seqs = gen.add(prompts, [steps + 3] * rows)
        streams = [TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) for _ in seqs]
        for i in range(steps + 2):  # the first two steps capture this shape's graph (or warm the kernels): untimed
            gen._run = timed_run if split and i >= 2 else run
            rows_now = sum(s.finish_reason is None for s in seqs)
            sync(device)
            t = time.perf_counter()
            gen.step()
            t1 = time.perf_counter()
            for seq, stream in zip(seqs, streams):
                if seq.finish_reason is None:
                    stream.feed(seq.tokens)
            t2 = time.perf_counter()
            if i < 2:
                continue
            if split:
                running.append(rows_now)
                host.append(t1 - t - forward[-1])
                detok.append(t2 - t1)
            else:
                wall.append(t2 - t)
        gen._run = run
        for seq in reversed(seqs):  # the highest slot first: nothing moves
            gen.drop(seq)
    sync(device)
    rows_running = statistics.mean(running)
    out = {"rows": rows, "rows_running_mean": rows_running, "steps": steps, "forward_ms": median_p90(forward),
           "host_ms": median_p90(host), "detokenise_ms": median_p90(detok),
           "host_us_per_row": 1e6 * statistics.median(host) / max(rows_running, 1),
           "detokenise_us_per_row": 1e6 * statistics.median(detok) / max(rows_running, 1),
           "step_wall_ms": median_p90(wall), "finish_reasons": dict(Counter(s.finish_reason for s in seqs))}
    log(f"timeline {label} {rows:3d} rows: forward {out['forward_ms']['p50']:.3f} ms, host {out['host_ms']['p50']:.3f} ms "
        f"({out['host_us_per_row']:.1f} us a row), detokenise {out['detokenise_ms']['p50']:.3f} ms; unsynchronised "
        f"{out['step_wall_ms']['p50']:.3f} ms a step")
    return out


READY = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ocr_latent.serving.engine import Engine, EngineConfig
engine = Engine(EngineConfig.from_env()).start()
engine.wait_ready(float(sys.argv[1]))
print(json.dumps({"ready": engine.ready, "failed": engine.failed}))
"""


def full_vocab_tokenizer(vocab_size: int):
    """The nano tokenizer, with every id up to `vocab_size` a word of its own (" w<id>", an added token): as
    the real tokenizer, every id a random model may read decodes to text, so that a stream of them carries
    pieces of text (with nano's 100 ids alone almost none would, and TTFT and ITL would measure nothing)."""
    from tokenizers import AddedToken, Tokenizer
    tokenizer = Tokenizer.from_file(str(ROOT / "weights" / "nano" / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(tokenizer.get_vocab_size(), vocab_size)])
    return tokenizer


def write_checkpoint(encoder, decoder, cfg: dict, dtype, out: Path) -> dict:
    """The random model as an original-layout checkpoint in `out` (safetensors, config.json, nano's special
    tokens and a tokenizer of the whole vocabulary) with a quantizer made for it: what MODEL_DIR and
    QUANTIZER of a service, or train.py quantizer --base, read."""
    from ocr_latent.serving.pipeline import base_fingerprint
    from ocr_latent.quantizer import FSQ
    from ocr_latent.architecture import ARCHITECTURE
    nano = ROOT / "weights" / "nano"
    t = time.perf_counter()
    model = OCRModel(cfg, encoder, decoder, SpecialTokens.from_files(nano, cfg), full_vocab_tokenizer(decoder.cfg.vocab_size))
    save_model(model, out, dtype)
    shutil.copy(nano / "tokenizer_config.json", out)
    geometry = ARCHITECTURE["codes"]
    quantizer = FSQ(decoder.cfg.hidden_size, geometry["tokens"], [geometry["levels"]] * geometry["dims"])
    quantizer.save(out / "quantizer.safetensors", {"base_model": "random", "base_fingerprint": base_fingerprint(model)})
    out_info = {"dir": str(out), "write_s": time.perf_counter() - t,
                "checkpoint_gb": sum(f.stat().st_size for f in out.iterdir()) / 1e9}
    log(f"wrote the random model to {out}: {out_info['checkpoint_gb']:.1f} GB in {out_info['write_s']:.1f} s")
    return out_info


def time_to_healthy(encoder, decoder, cfg: dict, device, dtype, timeout_s: float) -> dict:
    """The random model as a checkpoint on disk, and a fresh process timed from its start to a ready engine."""
    work = Path(tempfile.mkdtemp(prefix="ocr-latent-gpu-bench-"))
    try:
        written = write_checkpoint(encoder, decoder, cfg, dtype, work)
        env = {**os.environ, "MODEL_DIR": str(work), "QUANTIZER": str(work / "quantizer.safetensors"),
               "DEVICE": str(device), "DTYPE": str(dtype).removeprefix("torch.")}  # a name DTYPE accepts
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", READY, str(timeout_s)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s + 60)
        healthy_s = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    status = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    if not status.get("ready"):
        raise RuntimeError(f"the engine did not become ready (exit {proc.returncode}): {status.get('failed')}\n{proc.stderr[-3000:]}")
    phases = re.search(r"loaded in ([\d.]+)s, warmed up in ([\d.]+)s", proc.stderr)
    out = {"time_to_healthy_s": healthy_s, "checkpoint_gb": written["checkpoint_gb"], "write_checkpoint_s": written["write_s"],
           "load_s": float(phases[1]) if phases else None, "warmup_s": float(phases[2]) if phases else None}
    log(f"time to healthy: {healthy_s:.1f} s (a {out['checkpoint_gb']:.1f} GB checkpoint; load {out['load_s']} s, warm-up {out['warmup_s']} s)")
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two runs' tokens agree: sequences equal throughout, and the mean length of the common prefix."""
    prefix = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return {"sequences_equal": sum(x == y for x, y in zip(a, b)) / len(a),
            "mean_common_prefix": statistics.mean(prefix(x, y) for x, y in zip(a, b))}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, the nano config, small sizes: a check that the script runs")
    ap.add_argument("--config", help="config.json (default: bench/deepseek-ocr-config.json; --tiny: weights/nano)")
    ap.add_argument("--device", help="default cuda (--tiny: cpu)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 (--tiny: float32)")
    ap.add_argument("--encode-batches", help="default 1,8,32 (--tiny: 1,2)")
    ap.add_argument("--concurrency", help="default 1,16,64,128 (--tiny: 1,4)")
    ap.add_argument("--compile-levels", help="levels also run with torch.compile'd steps, graph-captured on CUDA "
                    "(default 1,128 on CUDA; none on the CPU)")
    ap.add_argument("--prompt-len", type=int, help="default 280 (--tiny: 64)")
    ap.add_argument("--new-tokens", type=int, help="default 128 (--tiny: 16)")
    ap.add_argument("--encode-iters", type=int, help="default 5 (--tiny: 1)")
    ap.add_argument("--timeline-rows", help="step timelines (forward, host, detokenisation) at these rows "
                    "(default 128; --tiny: 4; empty: none)")
    ap.add_argument("--timeline-steps", type=int, help="timed steps of a timeline, twice (default 64; --tiny: 24)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip what would start after this many seconds")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--no-healthy", action="store_true", help="skip the time-to-healthy section (it writes the "
                    "whole model to a temporary directory: 6.7 GB for DeepSeek-OCR)")
    ap.add_argument("--write-checkpoint", type=Path, metavar="DIR", help="only write the random model to DIR as a "
                    "checkpoint with a quantizer (what MODEL_DIR and QUANTIZER read), print its JSON and stop")
    ap.add_argument("--profile", type=Path, help="append torch.profiler tables of a few decode steps to this file")
    ap.add_argument("--out", type=Path, help="also write the JSON here, after every section")
    ap.add_argument("--deterministic", action="store_true", help="decoder.set_deterministic(True): every run must "
                    "give the same tokens, and the first sequence the same alone as among the others (same slots)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    pick = lambda value, full, small: value if value is not None else (small if tiny else full)
    args.config = Path(pick(args.config, ROOT / "bench" / "deepseek-ocr-config.json", ROOT / "weights" / "nano" / "config.json"))
    args.device = torch.device(pick(args.device, "cuda", "cpu"))
    args.dtype = DTYPES[pick(args.dtype, "bf16", "float32")]
    ints = lambda text: [int(x) for x in text.split(",") if x]
    args.batches = ints(pick(args.encode_batches, "1,8,32", "1,2"))
    args.levels = ints(pick(args.concurrency, "1,16,64,128", "1,4"))
    args.compiled = set(ints(args.compile_levels if args.compile_levels is not None else
                             "1,128" if args.device.type == "cuda" else ""))
    args.timeline = ints(pick(args.timeline_rows, "128", "4"))
    args.timeline_steps = pick(args.timeline_steps, 64, 24)
    args.prompt_len, args.new_tokens = pick(args.prompt_len, 280, 64), pick(args.new_tokens, 128, 16)
    args.encode_iters = pick(args.encode_iters, 5, 1)
    return args


def decode_levels(decoder, args, result: dict, over, save) -> None:
    """Each level's decode modes (eager twice, graphs, compiled variants) and how far their tokens agree."""
    device, compiled_mode = args.device, result["compiled_mode"]
    in_place_rows = next(layer.mlp for layer in decoder.layers if not layer.dense).in_place_rows
    for c in args.levels:
        tokens = {}
        # eager twice: how far two runs of the same kernels agree (the baseline for the other modes)
        modes = ["eager", "eager_again"] + (["cuda_graph"] if device.type == "cuda" else []) + ([compiled_mode] if c in args.compiled else [])
        if c in args.compiled and c <= in_place_rows:
            # few rows: compiled steps compute projections as fused reductions and read each row's experts in
            # place; the same with GEMM calls for the projections, and with those and the grouped GEMMs
            modes += [f"{compiled_mode}_{v}" for v in IN_PLACE]
        if args.deterministic and c > 1:
            modes += [m + "_alone" for m in modes if m in ("eager", "cuda_graph")]
        for mode in modes:
            if over():
                result["skipped"].append(f"decode {mode} {c}")
                continue
            try:
                result["decode"].setdefault(mode, {})[str(c)], tokens[mode] = bench_decode(
                    decoder, c, args.prompt_len, args.new_tokens, mode.startswith("cuda_graph"), device,
                    seed=0 if args.deterministic else c, profile=args.profile, compile=mode.startswith(compiled_mode),
                    label=mode, alone=mode.endswith("_alone"), in_place=IN_PLACE.get(mode.rsplit("_", 1)[-1], (True, True)))
            except Exception as e:  # noqa: BLE001 - on a first GPU, one failing mode must not hide the others
                log(f"decode {mode} concurrency {c} failed: {type(e).__name__}: {e}")
                result["decode"].setdefault(mode, {})[str(c)] = {"error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
        for mode in sorted(tokens.keys() - {"eager"}):
            if mode.endswith("_alone"):  # batch invariance: the first sequence alone against it among c - 1 others
                if mode.removesuffix("_alone") in tokens:
                    result.setdefault("alone_equals_in_batch", {})[f"{mode.removesuffix('_alone')} {c}"] = \
                        tokens[mode][0] == tokens[mode.removesuffix("_alone")][0]
                continue
            if "eager" in tokens:
                result["tokens_vs_eager"][f"{mode} {c}"] = agreement(tokens["eager"], tokens[mode])


# the step timeline's runs, Generator's options by name: the n-gram ban checked by the host row by row (a
# CPU's default, and the GPU's before), as tensor ops in the step, and those with the host's work overlapped
TIMELINE_MODES = {"host_rule": {"device_rule": False}, "device_rule": {"device_rule": True, "overlap": False},
                  "device_rule_overlap": {"device_rule": True, "overlap": True}}


def timelines(decoder, args, result: dict, over, save) -> None:
    graphs = args.device.type == "cuda"
    for rows in args.timeline:
        for mode, options in TIMELINE_MODES.items():
            if over():
                result["skipped"].append(f"timeline {mode} {rows}")
                continue
            try:
                result["timeline"].setdefault(mode, {})[str(rows)] = step_timeline(
                    decoder, rows, args.prompt_len, args.timeline_steps, graphs, args.device, label=mode, **options)
            except Exception as e:  # noqa: BLE001
                log(f"timeline {mode} {rows} rows failed: {type(e).__name__}: {e}")
                result["timeline"].setdefault(mode, {})[str(rows)] = {"error": f"{type(e).__name__}: {e}"}
            save()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.deterministic:
        set_deterministic(True)  # before the first GEMM: cuBLAS reads its workspace setting when its handle is made
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype, config = args.device, args.dtype, args.config
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
    if args.write_checkpoint:
        args.write_checkpoint.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"params": params, "build_s": build_s, "dtype": str(dtype).removeprefix("torch."),
                          "config": str(config), **write_checkpoint(encoder, decoder, cfg, dtype, args.write_checkpoint)}))
        return
    compiled_mode = "cuda_graph_compiled" if device.type == "cuda" else "compiled"  # a CPU has no graphs
    in_place_rows = next(layer.mlp for layer in decoder.layers if not layer.dense).in_place_rows
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
              "params": params, "build_s": build_s, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "moe_decode": "grouped_mm" if grouped_mm_works(device, dtype) else "gathered/dense",
              "compiled_mode": compiled_mode,
              "encode": {}, "decode": {"eager": {}, "eager_again": {}, "cuda_graph": {} if device.type == "cuda" else None,
                                       compiled_mode: {} if args.compiled else None,
                                       **{f"{compiled_mode}_{v}": {} if any(c <= in_place_rows for c in args.compiled) else None
                                          for v in IN_PLACE}},
              "tokens_vs_eager": {}, "timeline": {}, "skipped": []}
    save = lambda: args.out.write_text(json.dumps(result) + "\n") if args.out else None
    save()
    reset_peak(device)
    result["encode"] = bench_encode(encoder, args.batches, device, dtype, args.encode_iters)
    result["encode_peak_gb"] = peak_gb(device)
    save()
    decode_levels(decoder, args, result, over, save)
    timelines(decoder, args, result, over, save)
    result["deterministic"] = args.deterministic
    if args.no_healthy or over():
        result["skipped"].append("healthy")
    else:
        try:
            result["healthy"] = time_to_healthy(encoder, decoder, cfg, device, dtype, timeout_s=600)
        except Exception as e:  # noqa: BLE001
            log(f"time to healthy failed: {type(e).__name__}: {e}")
            result["healthy"] = {"error": f"{type(e).__name__}: {str(e)[:4000]}"}
    result["peak_gb"] = max([result["encode_peak_gb"]] + [d["peak_gb"] for m in result["decode"].values() if m
                                                         for d in m.values() if "peak_gb" in d])
    result["wall_s"] = time.perf_counter() - start
    save()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
