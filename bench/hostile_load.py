"""Hostile uploads under load (issue 30): what a burst of hostile files costs the running service.

    nice -n 5 .venv/bin/python bench/hostile_load.py                  # starts ./serve.sh on a free port
    .venv/bin/python bench/hostile_load.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Phases, one after another, each sent at once: one PDF bomb (a ~2 KB page that draws a rectangle 10^6
times through nested form XObjects), two bombs, 12 lying JPEGs (~330 bytes whose header claims
6600x6000 with 8x8 of data), 8 PNGs of 6000x6600 (a white page with a few lines of text). Meanwhile
/health is polled every 0.5 s from its own thread and the RSS of the server and all its descendants
(the PDF workers) is sampled every 0.2 s from /proc. Criteria: every reply within 90 s and no 5xx
but a 503 with Retry-After; /health always a 200 within 3 s; peak RSS at most 1.5 GB above the idle
server, and at most 400 MB above it 20 s after the last reply. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image, ImageDraw, ImageFont

from ocr_latent.examples.hostile import bomb, lying_jpeg
from throughput import start_server

ROOT = Path(__file__).resolve().parents[1]
GB, MB = 10**9, 10**6
LIMITS = {"reply_s": 90.0, "health_s": 3.0, "peak_bytes": 1.5 * GB, "held_bytes": 400 * MB}


# ----------------------------------------------------------------------------- the files
def big_png(width: int = 6000, height: int = 6600, seed: int = 0) -> bytes:
    """A white RGB page of width x height with a few lines of large black text: compresses to a few hundred KB."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    try:
        font = ImageFont.load_default(size=120)
    except (TypeError, OSError):  # Pillow without FreeType
        font = ImageFont.load_default()
    for line in range(8):
        draw.text((300, 400 + line * 300), f"page {seed}, line {line}: a few words of ordinary text", fill="black",
                  font=font)
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=6)
    return buf.getvalue()


# ----------------------------------------------------------------------------- watching the server
def descendants(pid: int) -> list[int]:
    """pid and every process under it (the PDF workers), from /proc/<pid>/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue  # the thread or process ended while we looked
    return out


def rss_of(pid: int) -> int:
    """VmRSS of pid and its descendants, bytes (shared pages counted in each process: an upper bound)."""
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class Watch:
    """Two threads: RSS samples every 0.2 s, /health every 0.5 s; each a (monotonic time, value) list."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid, self.stop = url, pid, threading.Event()
        self.rss: list[tuple[float, int]] = []
        self.health: list[tuple[float, float, int]] = []  # (sent at, seconds, status; 0 = no answer)
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._sample, self._poll)]

    def start(self) -> "Watch":
        for t in self.threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _sample(self) -> None:
        while not self.stop.wait(0.2):
            self.rss.append((time.monotonic(), rss_of(self.pid)))

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    status = c.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((sent, time.monotonic() - sent, status))
                self.stop.wait(max(0.0, 0.5 - (time.monotonic() - sent)))

    def rss_between(self, t0: float, t1: float) -> list[int]:
        return [v for t, v in self.rss if t0 <= t <= t1]

    def health_between(self, t0: float, t1: float) -> list[tuple[float, int]]:
        return [(s, status) for t, s, status in self.health if t0 <= t <= t1]


# ----------------------------------------------------------------------------- the scenario
def send(url: str, data: bytes, content_type: str) -> dict:
    started = time.monotonic()
    try:
        with httpx.Client(timeout=LIMITS["reply_s"] + 60) as c:
            r = c.post(url + "/encode", content=data, headers={"Content-Type": content_type})
        kind = r.json().get("error", {}).get("type", "") if r.status_code >= 400 else ""
        return {"status": r.status_code, "s": time.monotonic() - started, "type": kind,
                "retry_after": r.headers.get("retry-after"), "message": r.text[:300] if r.status_code >= 400 else ""}
    except (httpx.HTTPError, ValueError) as e:
        return {"status": 0, "s": time.monotonic() - started, "type": type(e).__name__, "retry_after": None,
                "message": str(e)[:300]}


def run_phase(url: str, name: str, data: bytes, content_type: str, count: int, watch: Watch, idle: int) -> dict:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(lambda _: send(url, data, content_type), range(count)))
    t1 = time.monotonic()
    time.sleep(0.3)  # one more RSS sample after the replies
    health = watch.health_between(t0, t1)
    statuses: dict[str, int] = {}
    for r in replies:
        key = f"{r['status']} {r['type']}".strip()
        statuses[key] = statuses.get(key, 0) + 1
    bad = [r for r in replies
           if r["status"] == 0 or r["status"] >= 500 and not (r["status"] == 503 and r["retry_after"])]
    return {"phase": name, "requests": count, "bytes": len(data), "statuses": statuses,
            "max_latency_s": round(max(r["s"] for r in replies), 2),
            "health_max_s": round(max((s for s, _ in health), default=0.0), 2),
            "health_failures": sum(status != 200 for _, status in health),
            "peak_above_idle_mb": round((max(watch.rss_between(t0, t1 + 0.3), default=idle) - idle) / MB),
            "bad_replies": [r["message"] or r["type"] for r in bad][:3], "ended": t1,
            "messages": sorted({r["message"][:160] for r in replies if r["message"]})[:3]}


def idle_rss(pid: int, seconds: float = 3.0) -> int:
    samples = []
    for _ in range(int(seconds / 0.2)):
        samples.append(rss_of(pid))
        time.sleep(0.2)
    return int(statistics.median(samples))


def verdict(phases: list[dict], peak: int, held: int, idle: int) -> dict:
    return {
        "replies_within_90s": all(p["max_latency_s"] <= LIMITS["reply_s"] for p in phases),
        "no_5xx_but_503_retry_after": not any(p["bad_replies"] for p in phases),
        "health_within_3s": all(p["health_max_s"] <= LIMITS["health_s"] and not p["health_failures"] for p in phases),
        "peak_at_most_1_5gb_above_idle": peak - idle <= LIMITS["peak_bytes"],
        "held_at_most_400mb_after_20s": held - idle <= LIMITS["held_bytes"],
    }


def scenario(url: str, pid: int, settle_s: float, pngs: int, jpegs: int) -> dict:
    print("building the files ...", file=sys.stderr, flush=True)
    files = [("1 PDF bomb", bomb(), "application/pdf", 1), ("2 PDF bombs", bomb(), "application/pdf", 2),
             (f"{jpegs} lying JPEGs", lying_jpeg(), "image/jpeg", jpegs),
             (f"{pngs} PNGs 6000x6600", big_png(), "image/png", pngs)]
    idle = idle_rss(pid)
    watch = Watch(url, pid).start()
    phases = []
    for name, data, ctype, count in files:
        print(f"phase: {name} ({len(data):,} bytes each) ...", file=sys.stderr, flush=True)
        phases.append(run_phase(url, name, data, ctype, count, watch, idle))
    last = phases[-1]["ended"]
    time.sleep(max(0.0, last + settle_s - time.monotonic()))
    held = rss_of(pid)
    watch.close()
    health_all = [s for _, s, _ in watch.health]
    peak = max((v for _, v in watch.rss), default=idle)
    for p in phases:
        del p["ended"]
    return {"idle_mb": round(idle / MB), "peak_above_idle_mb": round((peak - idle) / MB),
            "held_above_idle_after_s": settle_s, "held_above_idle_mb": round((held - idle) / MB),
            "health_polls": len(health_all), "health_max_s": round(max(health_all, default=0.0), 2),
            "health_failures": sum(status != 200 for _, _, status in watch.health),
            "phases": phases, "pass": verdict(phases, peak, held, idle)}


def print_table(result: dict) -> None:
    print(f"idle RSS (server + children): {result['idle_mb']} MB")
    print(f"{'phase':<22} {'statuses':<44} {'max s':>6} {'health max s':>12} {'peak +MB':>9}")
    for p in result["phases"]:
        statuses = ", ".join(f"{n}x {k}" for k, n in sorted(p["statuses"].items()))
        print(f"{p['phase']:<22} {statuses:<44} {p['max_latency_s']:>6.2f} {p['health_max_s']:>12.2f} "
              f"{p['peak_above_idle_mb']:>9}")
        for m in p["messages"]:
            print(f"{'':<22}   {m}")
    print(f"peak above idle: {result['peak_above_idle_mb']} MB; {result['held_above_idle_after_s']:g} s after the "
          f"last reply: {result['held_above_idle_mb']} MB above idle; /health: {result['health_polls']} polls, "
          f"max {result['health_max_s']} s, {result['health_failures']} failed")
    for name, ok in result["pass"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (with --pid); default: start ./serve.sh on a free port")
    ap.add_argument("--pid", type=int, help="the running server's process id (its RSS and its children's)")
    ap.add_argument("--settle-s", type=float, default=20.0, help="when to read the RSS held after the last reply")
    ap.add_argument("--pngs", type=int, default=8)
    ap.add_argument("--jpegs", type=int, default=12)
    ap.add_argument("--log", type=Path, default=Path("/tmp/hostile_load_server.log"),
                    help="where the started server's output goes")
    args = ap.parse_args()
    if bool(args.url) != bool(args.pid):
        ap.error("--url and --pid go together")
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url, _, _ = start_server({"LOG_LEVEL": "info"}, ["bash", str(ROOT / "serve.sh")], args.log)
        pid = proc.pid
    try:
        result = scenario(url, pid, args.settle_s, args.pngs, args.jpegs)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print_table(result)
    print(json.dumps(result))
    return 0 if all(result["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
