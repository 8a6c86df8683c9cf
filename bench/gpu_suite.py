"""Everything a first GPU hour must show, in one run of at most 8 minutes on one H200: `bash bench/gpu_suite.sh`.

    bash bench/gpu_suite.sh                  # CUDA: outputs under docs/gpu-<gpu>/suite-<commit>/
    bash bench/gpu_suite.sh --tiny           # the same sections on the CPU at tiny sizes (a temporary --out)
    bash bench/gpu_suite.sh --only gpu_bench,quantizer   # some sections again (names below)

Sections, in order, each with a time cap inside the whole run's --budget-s (480 s); one that fails or runs
out of time is recorded as such and the run goes on, one that needs a failed one is skipped:
  1 checkpoint    the full-size DeepSeek-OCR architecture with random weights, written once to a temporary
                  directory as a checkpoint with its quantizer (bench/gpu.py --write-checkpoint);
  2 serve_compiled  the real service (server.py) on it, DECODE_SLOTS=128 COMPILE=1, timed from its start to
                  the first 200 from /health;
  3 load_T_C      bench/serve_load.py --random-codes against it, C clients (1, 16, 64, 128), T output tokens
                  (256, 1,024), one run each: output tokens/s, TTFT, TPOT, ITL;
  4 encode        bench/serve_load.py --encode-only at 16 clients: pages/s and latency over HTTP;
  5 serve_eager, eager_load_256_C   the service restarted with COMPILE=0, and shorter loads at 1 and 128;
  6 gpu_bench     bench/gpu.py at HEAD with a reduced budget (decode modes at 1 and 128, the step timeline);
  7 quantizer     train.py quantizer at full size (bench/quantizer_speed.py): 30 steps at batch 8 and at the
                  largest of 32 or 16 that fits; seconds a step, peak memory, feature caching pages/s;
  8 agreement     compiled against eager decode steps on the embedded nano model reading held-out pages,
                  fp32 (must be identical) and bf16 (reported) (bench/token_agreement.py).
Each section's output goes to NAME.json (its JSON line) and NAME.log (everything it printed) in the output
directory, with commit.txt and suite.json (every section's status, seconds and headline figures). A
table, then suite.json's content as one JSON line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# every size the run takes, on a GPU and with --tiny (CPU, the nano config: a check that every section runs)
SIZES = {
    "full": {
        "budget_s": 480, "checkpoint": [], "healthy_s": 240,
        "service": {"DEVICE": "cuda", "DTYPE": "bf16", "KV_CACHE_TOKENS": str(128 * 2048)},
        "load": [(t, c, max(4 if t == 256 else 2, c * (2 if t == 256 else 1))) for t in (256, 1024) for c in (1, 16, 64, 128)],
        "load_cap_s": 60, "eager_load": [(256, 1, 4), (256, 128, 128)],
        "encode": ["--clients", "16", "--requests", "256", "--page-count", "32"],
        "gpu_bench": ["--budget-s", "60", "--concurrency", "1,128", "--compile-levels", "", "--encode-batches", "1,8",
                      "--encode-iters", "3", "--new-tokens", "64", "--no-healthy", "--timeline-rows", "128",
                      "--timeline-steps", "32"],
        "quantizer": ["--device", "cuda", "--dtype", "bf16", "--steps", "30", "--cache-pages", "64", "--batches", "8",
                      "--largest", "32,16", "--timeout", "200"],
        "agreement": ["--device", "cuda", "--pages", "16", "--max-tokens", "256", "--slots", "16"],
        "caps": {"checkpoint": 150, "encode": 60, "gpu_bench": 150, "quantizer": 240, "agreement": 150},
    },
    "tiny": {
        "budget_s": 600, "checkpoint": ["--tiny"], "healthy_s": 180,
        # 4 slots: a CPU compiles the warm-up's three shapes, not the five that 128 slots bring (a minute more)
        "service": {"DEVICE": "cpu", "DTYPE": "float32", "DECODE_SLOTS": "4", "KV_CACHE_TOKENS": str(4 * 512),
                    "TORCH_THREADS": "1"},
        "load": [(t, c, 2) for t in (8, 16) for c in (1, 2)], "load_cap_s": 60, "eager_load": [(8, 1, 2), (8, 2, 2)],
        "encode": ["--clients", "2", "--requests", "4", "--page-count", "2"],
        "gpu_bench": ["--tiny", "--threads", "1", "--concurrency", "1", "--compile-levels", "", "--encode-batches", "1",
                      "--new-tokens", "8", "--no-healthy", "--timeline-rows", "4", "--timeline-steps", "8"],
        "quantizer": ["--device", "cpu", "--dtype", "fp32", "--steps", "2", "--cache-pages", "4", "--batches", "2",
                      "--largest", "4,3"],
        "agreement": ["--pages", "2", "--max-tokens", "16", "--slots", "2", "--threads", "1"],
        "caps": {"checkpoint": 120, "encode": 60, "gpu_bench": 120, "quantizer": 180, "agreement": 240},
    },
}
SERVICE = {"DECODE_SLOTS": "128", "MAX_QUEUE": "1024", "REQUEST_TIMEOUT_S": "600", "LOG_LEVEL": "info", "HOST": "127.0.0.1"}
LEAST_S = 10  # a section with less than this left of the budget is skipped


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def commit() -> tuple[str, bool]:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "HEAD") or "unknown", bool(git("status", "--porcelain", "--untracked-files=no"))


def gpu_slug() -> str:
    """e.g. "h200" for "NVIDIA H200"."""
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"gpu_suite: no CUDA device (torch {torch.__version__}); --tiny runs on the CPU")
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


class Suite:
    """Runs sections against one budget and records each: status, seconds, its JSON and log files."""

    def __init__(self, out: Path, budget_s: float, only: set[str] | None):
        self.out, self.budget_s, self.only = out, budget_s, only
        self.start, self.sections = time.monotonic(), []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only or name.split("_")[0] in self.only

    def record(self, name: str, status: str, seconds: float = 0.0, **extra) -> dict:
        entry = {"name": name, "status": status, "seconds": round(seconds, 1), **extra}
        self.sections.append(entry)
        log(f"[{time.monotonic() - self.start:6.1f} s] {name}: {status} ({seconds:.1f} s)"
            + (f": {extra['error']}" if "error" in extra else ""))
        return entry

    def skip(self, name: str, why: str) -> None:
        if self.wanted(name):
            self.record(name, "skipped", error=why)

    def room(self, name: str, cap_s: float, needed: bool = False) -> float | None:
        """Seconds `name` may take (its cap, or what is left of the budget), or None: skipped. `needed`: run
        it even where --only leaves it out (another section needs it)."""
        if not (needed or self.wanted(name)):
            return None
        if self.left() < LEAST_S:
            self.record(name, "skipped", error=f"the budget of {self.budget_s:.0f} s is spent")
            return None
        return min(cap_s, self.left())

    def run(self, name: str, argv: list[str], cap_s: float, needed: bool = False) -> dict | None:
        """A section's command under its time limit; its last stdout line (JSON) to NAME.json. Returns the JSON."""
        limit = self.room(name, cap_s, needed)
        if limit is None:
            return None
        t = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=limit)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its whole group: a trainer's or a server's children too
            stdout, stderr = proc.communicate()
            status = "timeout"
        (self.out / f"{name}.log").write_text(f"$ {' '.join(argv)}\n{stderr}\n{stdout}")
        found = None
        for line in reversed(stdout.strip().splitlines()):
            try:
                found = json.loads(line)
                break
            except ValueError:
                continue
        if found is not None:
            (self.out / f"{name}.json").write_text(json.dumps(found, indent=1) + "\n")
        error = {} if status == "ok" else {"error": (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
        self.record(name, status, time.monotonic() - t, rc=proc.returncode, cap_s=round(limit), **error,
                    **({"json": f"{name}.json"} if found is not None else {}))
        return found if status == "ok" else None


class Service:
    """server.py in its own process group on a free port, its output in NAME.log; `healthy` polls /health."""

    def __init__(self, suite: Suite, name: str, env: dict):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.log_path, self.env = f"http://127.0.0.1:{self.port}", suite.out / f"{name}.log", env
        self.started = time.monotonic()
        self.proc = subprocess.Popen([PY, "server.py"], cwd=ROOT, env={**os.environ, **env, "PORT": str(self.port)},
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self, timeout_s: float) -> dict:
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() - self.started < timeout_s and self.proc.poll() is None:
                try:
                    r = c.get(self.url + "/health")
                    if r.status_code == 200:
                        return {"time_to_healthy_s": time.monotonic() - self.started, "health": r.json()}
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"not healthy after {time.monotonic() - self.started:.0f} s (exit {self.proc.poll()}): "
                           + " | ".join(self.log_path.read_text().strip().splitlines()[-3:])[-300:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def serve(suite: Suite, name: str, env: dict, timeout_s: float) -> Service | None:
    """The service started and timed to healthy, as section `name` (its JSON: time to healthy, load and
    warm-up seconds from its log, the settings); None where it did not become healthy."""
    limit = suite.room(name, timeout_s, needed=True)
    if limit is None:
        return None
    service = Service(suite, name, env)
    try:
        out = service.healthy(limit)
    except RuntimeError as e:
        service.stop()
        suite.record(name, "failed", time.monotonic() - service.started, error=str(e))
        return None
    phases = re.search(r"loaded in ([\d.]+)s, warmed up in ([\d.]+)s", service.log_path.read_text())
    out.update(load_s=float(phases[1]) if phases else None, warmup_s=float(phases[2]) if phases else None,
               settings={k: v for k, v in env.items() if k not in ("MODEL_DIR", "QUANTIZER")})
    (suite.out / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    suite.record(name, "ok", out["time_to_healthy_s"], json=f"{name}.json")
    return service


def loads(suite: Suite, service: Service | None, prefix: str, levels: list, cap_s: float) -> None:
    for tokens, clients, requests in levels:
        name = f"{prefix}_{tokens}_{clients}"
        if service is None:
            suite.skip(name, "no service")
            continue
        suite.run(name, [PY, "bench/serve_load.py", "--url", service.url, "--random-codes", "--clients", str(clients),
                         "--requests", str(requests), "--output-tokens", str(tokens), "--page-count", "16"], cap_s)


def run_sections(suite: Suite, size: dict, work: Path) -> None:
    caps, ckpt = size["caps"], work / "random-weights"  # the directory names the model in /health
    needs_model = any(map(suite.wanted, ("serve", "load", "encode", "eager", "quantizer")))
    written = suite.run("checkpoint", [PY, "bench/gpu.py", *size["checkpoint"], "--write-checkpoint", str(ckpt)],
                        caps["checkpoint"], needed=needs_model)
    model = {"MODEL_DIR": str(ckpt), "QUANTIZER": str(ckpt / "quantizer.safetensors")} if written else None
    for compile in ("1", "0"):
        name, prefix = ("serve_compiled", "load") if compile == "1" else ("serve_eager", "eager_load")
        levels = size["load"] if compile == "1" else size["eager_load"]
        dependents = [f"{prefix}_{t}_{c}" for t, c, _ in levels] + (["encode"] if compile == "1" else [])
        if not any(map(suite.wanted, [name, *dependents])):
            continue
        if model is None:
            suite.skip(name, "no checkpoint")
            service = None
        else:
            service = serve(suite, name, {**SERVICE, **size["service"], **model, "COMPILE": compile}, size["healthy_s"])
        try:
            loads(suite, service, prefix, levels, size["load_cap_s"])
            if compile == "1":
                if service is None:
                    suite.skip("encode", "no service")
                else:
                    suite.run("encode", [PY, "bench/serve_load.py", "--url", service.url, "--encode-only", *size["encode"]],
                              caps["encode"])
        finally:
            if service is not None:
                service.stop()
    suite.run("gpu_bench", [PY, "bench/gpu.py", *size["gpu_bench"]], caps["gpu_bench"])
    if model is None:
        suite.skip("quantizer", "no checkpoint")
    else:
        suite.run("quantizer", [PY, "bench/quantizer_speed.py", "--base", str(ckpt), "--work", str(work / "quantizer"),
                                *size["quantizer"]], caps["quantizer"])
    suite.run("agreement", [PY, "bench/token_agreement.py", "--variant", "compiled", "--dtypes", "float32,bf16",
                            *size["agreement"]], caps["agreement"])


def headline(out: Path) -> dict:
    """The figures a reader looks for first, from the sections' JSON files (absent where a section failed)."""
    read = lambda name: json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else None
    h = {}
    for name in ("serve_compiled", "serve_eager"):
        if r := read(name):
            h[f"{name}_healthy_s"] = round(r["time_to_healthy_s"], 1)
    for path in sorted(out.glob("*load_*.json")):
        level = json.loads(path.read_text())["levels"][0]
        h[path.stem] = {"output_tokens_per_s": round(level["output_tokens_per_s"], 1), "errors": level["errors"],
                        "tpot_ms_p50": level["tpot_ms"] and round(level["tpot_ms"]["p50"], 2),
                        "ttft_ms_p50": level["ttft_ms"] and round(level["ttft_ms"]["p50"], 1)}
    if r := read("encode"):
        h["encode_pages_per_s"] = round(r["levels"][0]["pages_per_s"], 2)
    if r := read("gpu_bench"):
        h["timeline"] = {f"{mode} {rows}": {k: round(t[k]["p50"], 3) for k in ("forward_ms", "host_ms", "step_wall_ms")}
                         for mode, by in r.get("timeline", {}).items() for rows, t in by.items() if "error" not in t}
    if r := read("quantizer"):
        h["quantizer"] = {"cache_pages_per_s": round(r["feature_cache"]["pages_per_s"], 2), "largest_batch": r.get("largest_batch"),
                          **{f"batch {x['batch']}": {"sec_per_step": x["sec_per_step"], "peak_gpu_mem_gb": x["peak_gpu_mem_gb"]}
                             for x in r["runs"] if x["rc"] == 0}}
    if r := read("agreement"):
        h["agreement"] = {d: f"{x['identical_pages']}/{x['pages']}" for d, x in r["dtypes"].items()}
    return h


# what the sections import (pyproject's dependencies that a bare GPU image may lack)
MODULES = ("torch", "numpy", "safetensors", "tokenizers", "einops", "PIL", "fastapi", "uvicorn", "pydantic_settings",
           "multipart", "prometheus_client", "tqdm", "rapidfuzz", "pypdfium2", "httpx", "ocr_latent")


def main(argv=None) -> None:
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"gpu_suite: {PY} cannot import {', '.join(missing)}: install the project's dependencies "
                 "(pyproject.toml; docs/gpu.md says how on a bare GPU machine)")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="every section on the CPU at tiny sizes (nano config)")
    ap.add_argument("--out", type=Path, help="output directory (default: docs/gpu-<gpu>/suite-<commit>/; --tiny: a "
                    "temporary directory)")
    ap.add_argument("--budget-s", type=float, help="the whole run's seconds (default 480; --tiny 600)")
    ap.add_argument("--only", help="run only these sections (comma-separated names or prefixes: load, eager, ...)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary checkpoint and caches")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "full"]
    head, dirty = commit()
    out = args.out or (Path(tempfile.mkdtemp(prefix="ocr-latent-gpu-suite-")) if args.tiny else
                       ROOT / "docs" / f"gpu-{gpu_slug()}" / f"suite-{head[:7]}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "commit.txt").write_text(f"{head}{' (with uncommitted changes)' if dirty else ''}\n")
    suite = Suite(out, args.budget_s or size["budget_s"], set(args.only.split(",")) if args.only else None)
    work = Path(tempfile.mkdtemp(prefix="ocr-latent-gpu-suite-work-"))
    log(f"gpu_suite: {'tiny, CPU' if args.tiny else 'CUDA'}; outputs in {out}; work in {work}; budget {suite.budget_s:.0f} s")
    try:
        run_sections(suite, size, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {"commit": head, "dirty": dirty, "tiny": args.tiny, "out": str(out), "budget_s": suite.budget_s,
              "wall_s": round(time.monotonic() - suite.start, 1), "sections": suite.sections, "headline": headline(out)}
    (out / "suite.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'section':<22} {'status':<8} {'seconds':>8}  note")
    for s in suite.sections:
        print(f"{s['name']:<22} {s['status']:<8} {s['seconds']:8.1f}  {s.get('error', '')}")
    print(f"{len(suite.sections)} sections in {result['wall_s']:.0f} s; outputs in {out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
