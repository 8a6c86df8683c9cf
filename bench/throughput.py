"""Service throughput, measured end to end over HTTP in one run.

Starts `server.py` (uvicorn) on a free loopback port (or uses --url), renders N held-out test pages,
and reports:
  * startup seconds (process start -> /health 200, model load and warm-up included);
  * /encode images/s at concurrency 1 and 16;
  * /decode requests/s and generated tokens/s at concurrency 1, 4 and 16, and the ratio of each
    to concurrency 1 (what continuous batching buys), with the mean decode batch size the server saw;
  * whether every concurrency level returned exactly the same codes / texts.

    .venv/bin/python bench/throughput.py                    # N=32 pages, embedded nano, CPU
    TORCH_THREADS=1 .venv/bin/python bench/throughput.py --n 32
    .venv/bin/python bench/throughput.py --n 64 --rounds 3    # levels interleaved 3 times, pooled
    .venv/bin/python bench/throughput.py --url http://host:8000 --n 64   # an already running server

Server configuration comes from the environment as for serve.sh (MODEL_DIR, DEVICE, TORCH_THREADS...).
The last line of output is the whole result as JSON.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from ocr_latent.training.pages import test_pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env_extra: dict, command: list[str] | None = None,
                 log: Path | None = None) -> tuple[subprocess.Popen, str, float, Path]:
    """The server (`command`, default `python server.py`; one that execs it, as serve.sh does, leaves
    proc.pid the server's) on a free port, its output in `log`: (process, url, seconds to healthy, log)."""
    port = free_port()
    log = log or Path(tempfile.mkstemp(prefix="ocr-latent-bench-", suffix=".log")[1])
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "LOG_LEVEL": "warning", **env_extra}
    t0 = time.monotonic()
    proc = subprocess.Popen(command or [sys.executable, "server.py"], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=2) as c:
        while True:
            if proc.poll() is not None:
                sys.exit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if c.get(url + "/health").status_code == 200:
                    return proc, url, time.monotonic() - t0, log
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > 600:
                proc.kill()
                sys.exit(f"server not healthy after 600 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def scrape(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run(pool_size: int, fn, items) -> tuple[list, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(pool_size) as pool:
        results = list(pool.map(fn, items))
    return results, time.perf_counter() - t0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="pages (and requests per concurrency level)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--decode-concurrency", default="1,4,16")
    ap.add_argument("--encode-concurrency", default="1,16")
    ap.add_argument("--seed", type=int, default=2, help="test_pages seed (test split, no augmentation)")
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the decode levels in turn (1, 4, 16, 1, 4, 16, ...) and pool them: on a machine whose "
                         "speed drifts, interleaving keeps the drift out of the ratios")
    return ap.parse_args(argv)


def encode_bodies(n: int, seed: int) -> list[dict]:
    """/encode JSON bodies of the first `n` held-out pages."""
    stream, payloads = test_pages(seed=seed), []
    for i in range(n):
        buf = io.BytesIO()
        stream[i].image.save(buf, "PNG")
        payloads.append({"image": base64.b64encode(buf.getvalue()).decode()})
    return payloads


def main(argv=None) -> None:
    args = parse_args(argv)
    dec_levels = [int(x) for x in args.decode_concurrency.split(",")]
    enc_levels = [int(x) for x in args.encode_concurrency.split(",")]

    payloads = encode_bodies(args.n, args.seed)
    proc, startup_s, log = None, None, None
    if args.url:
        url = args.url.rstrip("/")
    else:
        env = {"DECODE_SLOTS": str(max(dec_levels))} if "DECODE_SLOTS" not in os.environ else {}
        proc, url, startup_s, log = start_server(env)
        print(f"server healthy after {startup_s:.1f} s (log: {log})", flush=True)
    result: dict = {"n": args.n, "max_tokens": args.max_tokens, "startup_s": startup_s,
                    "torch_threads": os.environ.get("TORCH_THREADS"), "encode": {}, "decode": {}}
    try:
        with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
            health = client.get("/health").json()
            result["model"], result["device"] = health.get("model"), health.get("device")

            def encode(body):
                r = client.post("/encode", json=body)
                r.raise_for_status()
                return r.json()["codes_b64"]

            codes_by_level = {}
            encode(payloads[0])  # untimed
            for c in enc_levels:
                before = scrape(client)
                codes, wall = run(c, encode, payloads)
                after = scrape(client)
                batches = after["ocr_latent_encode_batch_size_count"] - before["ocr_latent_encode_batch_size_count"]
                codes_by_level[c] = codes
                result["encode"][c] = {"images_per_s": args.n / wall, "wall_s": wall,
                                       "mean_batch": args.n / batches if batches else None}
                print(f"encode  concurrency {c:3d}: {args.n / wall:7.2f} images/s  ({wall:6.2f} s, "
                      f"mean batch {result['encode'][c]['mean_batch'] or 0:.1f})", flush=True)
            result["encode_identical"] = all(v == codes_by_level[enc_levels[0]] for v in codes_by_level.values())

            def decode(codes_b64):
                r = client.post("/decode", json={"codes_b64": codes_b64, "max_tokens": args.max_tokens})
                r.raise_for_status()
                return r.json()

            codes = codes_by_level[enc_levels[0]]
            decode(codes[0])  # untimed
            texts, pooled = {}, {c: {"wall": 0.0, "tokens": 0.0, "steps": 0.0, "seq_steps": 0.0, "requests": 0,
                                           "step_s": 0.0, "prefill_s": 0.0, "prefills": 0.0} for c in dec_levels}
            per_round = {c: [] for c in dec_levels}  # tokens/s of each round
            for r in range(args.rounds):
                for c in dec_levels:
                    before = scrape(client)
                    outs, wall = run(c, decode, codes)
                    after = scrape(client)
                    tokens = after["ocr_latent_decode_tokens_total"] - before["ocr_latent_decode_tokens_total"]
                    p = pooled[c]
                    per_round[c].append(tokens / wall)
                    p["wall"], p["tokens"], p["requests"] = p["wall"] + wall, p["tokens"] + tokens, p["requests"] + args.n
                    p["steps"] += after["ocr_latent_decode_batch_size_count"] - before["ocr_latent_decode_batch_size_count"]
                    p["seq_steps"] += after["ocr_latent_decode_batch_size_sum"] - before["ocr_latent_decode_batch_size_sum"]
                    for key, metric in (("step_s", "decode_step_seconds_sum"), ("prefill_s", "prefill_seconds_sum"),
                                        ("prefills", "prefill_seconds_count")):
                        p[key] += after.get("ocr_latent_" + metric, 0.0) - before.get("ocr_latent_" + metric, 0.0)
                    reasons = {}
                    for o in outs:
                        reasons[o["finish_reason"]] = reasons.get(o["finish_reason"], 0) + 1
                    if texts.setdefault(c, outs) != outs:
                        texts[c] = None  # not even the same level agreed with itself
                    result["decode"][c] = d = {
                        "requests_per_s": p["requests"] / p["wall"], "tokens_per_s": p["tokens"] / p["wall"],
                        "wall_s": p["wall"], "tokens": int(p["tokens"]), "rounds": r + 1,
                        "mean_batch": p["seq_steps"] / p["steps"] if p["steps"] else None, "finish_reasons": reasons,
                        # where the wall time went: the worker in decode steps, in prefills, and the rest
                        # (waiting for requests, HTTP, detokenising)
                        "step_share": p["step_s"] / p["wall"], "prefill_share": p["prefill_s"] / p["wall"],
                        "mean_step_ms": 1e3 * p["step_s"] / p["steps"] if p["steps"] else None,
                        "mean_prefill_batch": p["requests"] / p["prefills"] if p["prefills"] else None}
                    print(f"decode  concurrency {c:3d}: {args.n / wall:7.2f} requests/s  {tokens / wall:8.1f} tokens/s  "
                          f"({wall:6.2f} s, {int(tokens)} tokens, mean batch {d['mean_batch'] or 0:.1f}, {reasons})"
                          + (f"  [round {r + 1}]" if args.rounds > 1 else ""), flush=True)
            result["decode_identical"] = all(v is not None and v == texts[dec_levels[0]] for v in texts.values())
    finally:
        if proc is not None:
            stop_server(proc)

    base_d, base_e = result["decode"][dec_levels[0]], result["encode"][enc_levels[0]]
    print()
    if startup_s is not None:
        print(f"startup: {startup_s:.1f} s to healthy")
    if args.rounds > 1:
        for c in dec_levels:
            d = result["decode"][c]
            print(f"decode  concurrency {c:3d}, {args.rounds} rounds pooled: {d['requests_per_s']:7.2f} requests/s  "
                  f"{d['tokens_per_s']:8.1f} tokens/s  (mean batch {d['mean_batch'] or 0:.1f})")
        for c in dec_levels[1:]:
            # each round's ratio against the concurrency-1 run of the same round; the median shrugs off
            # a round whose sequential run met a slow spell of the machine
            ratios = sorted(a / b for a, b in zip(per_round[c], per_round[dec_levels[0]]))
            result["decode"][c]["round_ratios"] = ratios
            print(f"decode batched/sequential at concurrency {c}, per round: "
                  + ", ".join(f"{r:.2f}x" for r in ratios) + f"; median {statistics.median(ratios):.2f}x")
    for c in dec_levels:
        d = result["decode"][c]
        print(f"decode  concurrency {c:3d}: wall time in decode steps {d['step_share']:.0%} ({d['mean_step_ms'] or 0:.2f} ms "
              f"each), in prefills {d['prefill_share']:.0%} ({d['mean_prefill_batch'] or 0:.1f} prompts each), "
              f"elsewhere {1 - d['step_share'] - d['prefill_share']:.0%}")
    for c in dec_levels[1:]:
        d = result["decode"][c]
        d["speedup_requests"] = d["requests_per_s"] / base_d["requests_per_s"]
        d["speedup_tokens"] = d["tokens_per_s"] / base_d["tokens_per_s"]
        print(f"decode batched/sequential at concurrency {c}: {d['speedup_requests']:.2f}x requests/s, "
              f"{d['speedup_tokens']:.2f}x tokens/s")
    for c in enc_levels[1:]:
        e = result["encode"][c]
        e["speedup"] = e["images_per_s"] / base_e["images_per_s"]
        print(f"encode batched/sequential at concurrency {c}: {e['speedup']:.2f}x images/s")
    print(f"identical results at every concurrency: encode {result['encode_identical']}, "
          f"decode {result['decode_identical']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
