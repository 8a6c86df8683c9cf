"""Hostile uploads and hostile clients under load (issue 30, and the slow-client / expensive-file issue after
it): what each costs the running service.

    nice -n 5 .venv/bin/python bench/hostile_load.py                  # every phase; starts ./serve.sh on a free port
    nice -n 5 .venv/bin/python bench/hostile_load.py --phases A,E     # some phases (names below, comma-separated)
    .venv/bin/python bench/hostile_load.py --url http://127.0.0.1:8000 --pid 1234 \\
        --body-timeout-s 30 --request-timeout-s 120                   # a running server: say what it was given

The server it starts gets BODY_TIMEOUT_S=--body-timeout-s (default 30, the server's default) and
REQUEST_TIMEOUT_S=--request-timeout-s (default 30, not the server's 120, so that phase D is short); with --url
the two flags must say what that server was given, since the criteria are computed from them. --phases picks
the phases (default: all): the issue-30 ones selected run first, one after another, then A-E in the order given;
before each of A-E the bench waits (at most 120 s) until the server tree uses under 20% of a core, so that one
phase's leftovers do not count in the next.
Meanwhile /health is polled every 0.5 s from its own thread (from 127.0.0.1; one kept-alive connection, but a
new connection for each poll during A) and the RSS of the server and all its descendants (the PDF workers) is
sampled every 0.2 s from /proc.

Issue 30, each sent at once, one after another; judged together:
  bomb   one PDF bomb (a ~2 KB page that draws a rectangle 10^6 times through nested form XObjects)
  bombs  two bombs
  jpegs  12 lying JPEGs (~330 bytes whose header claims 6600x6000 with 8x8 of data)
  pngs   8 PNGs of 6000x6600 (a white page with a few lines of text)
  Criteria: every reply within 90 s and no 5xx but a 503 with Retry-After; /health always a 200 within 3 s;
  peak RSS at most 1.5 GB above the idle server, and at most 400 MB above it 20 s after the last reply.
Hostile clients and expensive files:
  A  slow bodies: N connections (N = 200, then 999; --slow-counts), each from 127.0.0.2 (--attack-source; the
     server caps connections per client address, /health is polled from 127.0.0.1), sends the head of a POST
     /encode with Content-Length: 100000, then 10 body bytes, then stays silent; watched until all are closed
     or BODY_TIMEOUT_S + 10 s after the last head. Criteria: every one cut (closed by the server) within
     BODY_TIMEOUT_S + 5 s of its head; /health a 200 within 3 s throughout.
  B  progressive-JPEG scan bomb (examples/hostile.py scan_bomb: 212 KB, 4000x4000, ~3,800 scans, ~25-30 s of
     Pillow): 4 clients POST it to /encode and hang up after 5 s; 1 s after they start, a JSON /decode of 4096
     zero codes, max_tokens 8, is timed; then the server tree's CPU time (utime+stime of the server and its
     descendants, /proc/PID/stat) over the 10 s after the clients left. Criteria: that /decode a 200 within
     10 s; at most 5 s of CPU in those 10 s.
  C  40 concurrent POSTs of a 4095x4095 PNG (white, 4 lines of text, ~67 KB). Criteria: RSS peak at most 1.5 GB
     above the server before the phase, at most 400 MB above it 20 s after the last reply; every reply a 200
     or a 503 with Retry-After (no other 5xx, none unanswered).
  D  slow PDFs (examples/hostile.py slow_pdf: 32 pages of ~23 KB, each page ~3-5 s of PDFium at 1024): six of
     them and examples/two-pages.pdf sent at once to /encode; a client gives up REQUEST_TIMEOUT_S + 15 s after
     sending. Criteria: every reply within REQUEST_TIMEOUT_S + 10 s; no 5xx but a 503 with Retry-After or a 504.
  E  slot hogging: examples/page.png encoded once, a codes file of 32 copies of its codes POSTed twice at once
     to /decode?ignore_eos=true&max_tokens=N (N the max_tokens maximum of /openapi.json; halved on a 422), then
     after 2 s a lone JSON /decode with max_tokens 8; the hogs are hung up after it. Criterion: the lone
     /decode answers a 200, or a 503 with Retry-After, within 10 s.
Prints a table of every criterion (phase, check, figure, limit, pass), then one JSON line. Exit status 0 when
every criterion passes.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import io
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ocr_latent.client.codesfile import MEDIA_TYPE, CodesFile
from ocr_latent.examples.hostile import bomb, lying_jpeg, scan_bomb, slow_pdf
from throughput import start_server

ROOT = Path(__file__).resolve().parents[1]
GB, MB = 10**9, 10**6
LIMITS = {"reply_s": 90.0, "health_s": 3.0, "peak_bytes": 1.5 * GB, "held_bytes": 400 * MB}
OLD_PHASES = ("bomb", "bombs", "jpegs", "pngs")
NEW_PHASES = ("A", "B", "C", "D", "E")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- the files
def big_png(width: int = 6000, height: int = 6600, seed: int = 0, lines: int = 8, font_size: int = 120,
            crisp: bool = False, compress_level: int = 6) -> bytes:
    """A white RGB page of width x height with a few lines of black text: compresses to a few hundred KB (the
    defaults), or ~67 KB at 4095x4095 with 4 crisp (not anti-aliased) lines of 48 px at compress_level 9."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    if crisp:
        draw.fontmode = "1"
    try:
        font = ImageFont.load_default(size=font_size)
    except (TypeError, OSError):  # Pillow without FreeType
        font = ImageFont.load_default()
    for line in range(lines):
        draw.text((300, 400 + line * int(2.5 * font_size)), f"page {seed}, line {line}: a few words of ordinary text",
                  fill="black", font=font)
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=compress_level)
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


def cpu_of(pid: int) -> float:
    """CPU seconds (utime + stime, all threads) of pid and its descendants now, from /proc/<pid>/stat. A
    descendant that ends takes its seconds with it (a lower bound over an interval in which workers end)."""
    total = 0
    for p in descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / CLK_TCK


def quiet(pid: int, most_s: float = 120.0, share: float = 0.2, window_s: float = 2.0) -> float:
    """Wait until the server tree uses under `share` of a core over `window_s` (at most `most_s`); seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < most_s:
        before = cpu_of(pid)
        time.sleep(window_s)
        if cpu_of(pid) - before < share * window_s:
            break
    return round(time.monotonic() - t0, 1)


class Watch:
    """Two threads: RSS samples every 0.2 s, /health every 0.5 s; each a (monotonic time, value) list. /health
    goes over one kept-alive connection, or a new one each time while `fresh` is set (phase A: the question
    there is whether a new client gets in)."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid, self.stop, self.fresh = url, pid, threading.Event(), False
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
        with httpx.Client(timeout=30) as kept:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    if self.fresh:  # a new connection each time, as a load balancer's probe would
                        with httpx.Client(timeout=30) as c:
                            status = c.get(self.url + "/health").status_code
                    else:
                        status = kept.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((sent, time.monotonic() - sent, status))
                self.stop.wait(max(0.0, 0.5 - (time.monotonic() - sent)))

    def rss_between(self, t0: float, t1: float) -> list[int]:
        return [v for t, v in self.rss if t0 <= t <= t1]

    def health_between(self, t0: float, t1: float) -> list[tuple[float, int]]:
        return [(s, status) for t, s, status in self.health if t0 <= t <= t1]


# ----------------------------------------------------------------------------- talking to it
def send(url: str, data: bytes, content_type: str, timeout: float = LIMITS["reply_s"] + 60) -> dict:
    """POST /encode; the outcome, status 0 when no answer came (`timeout` s of silence, or a transport error)."""
    started = time.monotonic()
    try:
        with httpx.Client(timeout=timeout) as c:
            r = c.post(url + "/encode", content=data, headers={"Content-Type": content_type})
        kind = r.json().get("error", {}).get("type", "") if r.status_code >= 400 else ""
        return {"status": r.status_code, "s": time.monotonic() - started, "type": kind,
                "retry_after": r.headers.get("retry-after"), "message": r.text[:300] if r.status_code >= 400 else ""}
    except (httpx.HTTPError, ValueError) as e:
        return {"status": 0, "s": time.monotonic() - started, "type": type(e).__name__, "retry_after": None,
                "message": str(e)[:300]}


def post_decode(url: str, body: dict, timeout: float) -> dict:
    started = time.monotonic()
    try:
        with httpx.Client(timeout=timeout) as c:
            r = c.post(url + "/decode", json=body)
        return {"status": r.status_code, "s": round(time.monotonic() - started, 2),
                "retry_after": r.headers.get("retry-after"), "message": r.text[:200] if r.status_code >= 400 else ""}
    except httpx.HTTPError as e:
        return {"status": 0, "s": round(time.monotonic() - started, 2), "retry_after": None,
                "message": f"{type(e).__name__}: no answer within {timeout:g} s"}


def tally(replies: list[dict]) -> dict[str, int]:
    statuses: dict[str, int] = {}
    for r in replies:
        key = f"{r['status']} {r['type']}".strip()
        statuses[key] = statuses.get(key, 0) + 1
    return statuses


def answered(r: dict) -> str:
    return f"{r['status']} in {r['s']:.2f} s" if r["status"] else f"no answer in {r['s']:.1f} s"


def check(phase: str, name: str, figure, limit: str, ok: bool) -> dict:
    return {"phase": phase, "check": name, "figure": figure, "limit": limit, "pass": bool(ok)}


# ----------------------------------------------------------------------------- issue 30's phases
def run_phase(url: str, name: str, data: bytes, content_type: str, count: int, watch: Watch, idle: int) -> dict:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(lambda _: send(url, data, content_type), range(count)))
    t1 = time.monotonic()
    time.sleep(0.3)  # one more RSS sample after the replies
    health = watch.health_between(t0, t1)
    bad = [r for r in replies
           if r["status"] == 0 or r["status"] >= 500 and not (r["status"] == 503 and r["retry_after"])]
    return {"phase": name, "requests": count, "bytes": len(data), "statuses": tally(replies),
            "max_latency_s": round(max(r["s"] for r in replies), 2),
            "health_max_s": round(max((s for s, _ in health), default=0.0), 2),
            "health_failures": sum(status != 200 for _, status in health),
            "peak_above_idle_mb": round((max(watch.rss_between(t0, t1 + 0.3), default=idle) - idle) / MB),
            "bad_replies": [r["message"] or r["type"] for r in bad][:3], "started": t0, "ended": t1,
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


def upload_phases(ctx: "Context", names: list[str]) -> dict:
    """Issue 30's phases, one after another, judged together (as before the new phases)."""
    url, pid, watch, idle = ctx.url, ctx.pid, ctx.watch, ctx.idle
    files = {"bomb": ("1 PDF bomb", bomb(), "application/pdf", 1), "bombs": ("2 PDF bombs", bomb(), "application/pdf", 2),
             "jpegs": (f"{ctx.args.jpegs} lying JPEGs", lying_jpeg(), "image/jpeg", ctx.args.jpegs),
             "pngs": (f"{ctx.args.pngs} PNGs 6000x6600", big_png(), "image/png", ctx.args.pngs)}
    phases = []
    for key in names:
        name, data, ctype, count = files[key]
        print(f"phase {key}: {name} ({len(data):,} bytes each) ...", file=sys.stderr, flush=True)
        phases.append(run_phase(url, name, data, ctype, count, watch, idle))
    t0, last = phases[0]["started"], phases[-1]["ended"]
    time.sleep(max(0.0, last + ctx.args.settle_s - time.monotonic()))
    held = rss_of(pid)
    peak = max(watch.rss_between(t0, time.monotonic()), default=idle)
    health = [s for s, _ in watch.health_between(t0, last)]
    for p in phases:
        del p["started"], p["ended"]
    result = {"peak_above_idle_mb": round((peak - idle) / MB), "held_above_idle_after_s": ctx.args.settle_s,
              "held_above_idle_mb": round((held - idle) / MB), "health_polls": len(health),
              "health_max_s": round(max(health, default=0.0), 2), "phases": phases,
              "pass": verdict(phases, peak, held, idle)}
    figures = {"replies_within_90s": (f"{max(p['max_latency_s'] for p in phases):.2f} s", "<= 90 s"),
               "no_5xx_but_503_retry_after": (sum(len(p["bad_replies"]) for p in phases), "0 bad replies"),
               "health_within_3s": (f"{result['health_max_s']} s, {sum(p['health_failures'] for p in phases)} failed",
                                    "200 in < 3 s"),
               "peak_at_most_1_5gb_above_idle": (f"+{result['peak_above_idle_mb']} MB", "<= +1500 MB"),
               "held_at_most_400mb_after_20s": (f"+{result['held_above_idle_mb']} MB", "<= +400 MB")}
    result["checks"] = [check(",".join(names), k, *figures[k], ok) for k, ok in result["pass"].items()]
    return result


# ----------------------------------------------------------------------------- A: slow bodies
def raise_open_files() -> int:
    """RLIMIT_NOFILE's soft limit up to the hard one (every attacking socket is a file); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def slow_bodies(host: str, port: int, n: int, source: str, watch_s: float) -> dict:
    """n connections from `source`, each a POST /encode head claiming 100,000 bytes, then 10 of them, then
    silence; watched (non-blocking, one selector) until every one is closed or `watch_s` after the last head.
    Per connection: when it was closed, seconds after its head (None: still open at the end), and the first
    line of any answer."""
    head = (f"POST /encode HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: image/png\r\n"
            f"Content-Length: 100000\r\n\r\n").encode()
    sel = selectors.DefaultSelector()
    conns: dict[socket.socket, dict] = {}
    failures: dict[str, int] = {}
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((source, 0))
            s.settimeout(5.0)
            s.connect((host, port))
            s.sendall(head)
            sent = time.monotonic()
            s.sendall(b"\x89PNG\r\n\x1a\n\0\0")  # 10 body bytes
        except OSError as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
            s.close()
            continue
        s.setblocking(False)
        conns[s] = {"sent": sent, "closed_s": None, "answer": ""}
        sel.register(s, selectors.EVENT_READ)
    last_head = time.monotonic()
    open_ = len(conns)
    while open_ and time.monotonic() < last_head + watch_s:
        for key, _ in sel.select(timeout=0.25):
            s, c = key.fileobj, conns[key.fileobj]
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset by the server: cut as well
                chunk = b""
            if chunk:
                if not c["answer"]:
                    c["answer"] = chunk.split(b"\r\n", 1)[0][:60].decode("latin-1")
                continue
            c["closed_s"] = time.monotonic() - c["sent"]
            sel.unregister(s)
            s.close()
            open_ -= 1
    for s, c in conns.items():
        if c["closed_s"] is None:
            sel.unregister(s)
            s.close()
    sel.close()
    return {"connected": len(conns), "connect_failures": failures, "conns": list(conns.values()),
            "watched_s": round(time.monotonic() - last_head, 1)}


def phase_a(ctx: "Context") -> dict:
    split = urlsplit(ctx.url)
    host, port = split.hostname, split.port or 80
    limit_s = ctx.args.body_timeout_s + 5
    out, checks = {"nofile": ctx.nofile, "source": ctx.args.attack_source, "runs": []}, []
    for n in ctx.args.slow_counts:
        print(f"phase A: {n} slow bodies from {ctx.args.attack_source} ...", file=sys.stderr, flush=True)
        ctx.watch.fresh = True
        t0 = time.monotonic()
        try:
            run = slow_bodies(host, port, n, ctx.args.attack_source, ctx.args.body_timeout_s + 10)
        finally:
            ctx.watch.fresh = False
        t1 = time.monotonic()
        closed = sorted(c["closed_s"] for c in run["conns"] if c["closed_s"] is not None)
        within = sum(s <= limit_s for s in closed)
        answers: dict[str, int] = {}
        for c in run["conns"]:
            if c["answer"]:
                answers[c["answer"]] = answers.get(c["answer"], 0) + 1
        health = ctx.watch.health_between(t0, t1)
        health_max = max((s for s, _ in health), default=0.0)
        failed = sum(status != 200 or s >= LIMITS["health_s"] for s, status in health)
        summary = {"n": n, "connected": run["connected"], "connect_failures": run["connect_failures"],
                   "closed": len(closed), "closed_within_limit": within, "limit_s": limit_s,
                   "first_close_s": round(closed[0], 1) if closed else None,
                   "median_close_s": round(statistics.median(closed), 1) if closed else None,
                   "last_close_s": round(closed[-1], 1) if closed else None, "answers": answers,
                   "watched_s": run["watched_s"], "health_polls": len(health), "health_max_s": round(health_max, 2),
                   "health_failures": failed,
                   "health_statuses": sorted({status for _, status in health})}
        out["runs"].append(summary)
        when = f", closed at {summary['first_close_s']}-{summary['last_close_s']} s" if closed else ""
        checks.append(check("A", f"{n} slow bodies cut", f"{within}/{n} in time{when}", f"all, <= {limit_s:g} s",
                            within == n and run["connected"] == n))
        checks.append(check("A", f"/health during {n}", f"max {health_max:.2f} s, {failed}/{len(health)} failed",
                            "200 in < 3 s", failed == 0 and len(health) > 0))
        time.sleep(2.0)  # the server sees the rest go
    out["checks"] = checks
    return out


# ----------------------------------------------------------------------------- B: scan bomb
def phase_b(ctx: "Context") -> dict:
    data = scan_bomb()
    print(f"phase B: 4 scan bombs ({len(data):,} bytes each), hung up after 5 s ...", file=sys.stderr, flush=True)
    decode_body = {"codes": [0] * 4096, "max_tokens": 8}
    cpu_start = cpu_of(ctx.pid)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        bombs = [pool.submit(send, ctx.url, data, "image/jpeg", 5.0) for _ in range(4)]
        time.sleep(1.0)
        decoded = pool.submit(post_decode, ctx.url, decode_body, 20.0)
        replies = [f.result() for f in bombs]
        left = time.monotonic()
        cpu_left = cpu_of(ctx.pid)
        time.sleep(10.0)
        cpu_after = cpu_of(ctx.pid)
        d = decoded.result()
    used = round(cpu_after - cpu_left, 1)
    ok = d["status"] == 200 and d["s"] <= 10
    return {"bytes": len(data), "bombs": tally(replies), "bomb_max_s": round(max(r["s"] for r in replies), 2),
            "decode": d, "cpu_while_sending_s": round(cpu_left - cpu_start, 1), "cpu_10s_after_s": used,
            "checks": [check("B", "/decode during 4 bombs", answered(d), "200 in <= 10 s", ok),
                       check("B", "CPU in 10 s after they left", f"{used:.1f} s", "<= 5 s", used <= 5.0)]}


# ----------------------------------------------------------------------------- C: 40 large PNGs
def phase_c(ctx: "Context") -> dict:
    data = big_png(4095, 4095, lines=4, font_size=48, crisp=True, compress_level=9)
    print(f"phase C: 40 PNGs 4095x4095 ({len(data):,} bytes each) ...", file=sys.stderr, flush=True)
    before = idle_rss(ctx.pid, 2.0)
    p = run_phase(ctx.url, "C", data, "image/png", 40, ctx.watch, before)
    time.sleep(max(0.0, p["ended"] + 20.0 - time.monotonic()))
    held = rss_of(ctx.pid)
    peak = max(ctx.watch.rss_between(p["started"], time.monotonic()), default=before)
    bad = len(p["bad_replies"])
    out = {"bytes": len(data), "before_mb": round(before / MB), "statuses": p["statuses"],
           "max_latency_s": p["max_latency_s"], "peak_above_before_mb": round((peak - before) / MB),
           "held_above_before_mb_20s": round((held - before) / MB), "messages": p["messages"]}
    out["checks"] = [
        check("C", "RSS peak", f"+{out['peak_above_before_mb']} MB", "<= +1500 MB", peak - before <= LIMITS["peak_bytes"]),
        check("C", "RSS 20 s after", f"+{out['held_above_before_mb_20s']} MB", "<= +400 MB",
              held - before <= LIMITS["held_bytes"]),
        check("C", "replies 200 / 503+Retry-After", ", ".join(f"{n}x {k}" for k, n in sorted(p["statuses"].items())),
              "no other 5xx", bad == 0)]
    return out


# ----------------------------------------------------------------------------- D: slow PDFs
def phase_d(ctx: "Context") -> dict:
    slow, two = slow_pdf(), (ROOT / "examples" / "two-pages.pdf").read_bytes()
    limit_s, give_up_s = ctx.args.request_timeout_s + 10, ctx.args.request_timeout_s + 15
    print(f"phase D: 6 slow PDFs ({len(slow):,} bytes, 32 pages) and two-pages.pdf ...", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        futures = [pool.submit(send, ctx.url, slow, "application/pdf", give_up_s) for _ in range(6)]
        futures.append(pool.submit(send, ctx.url, two, "application/pdf", give_up_s))
        replies = [f.result() for f in futures]
    ok_status = lambda r: r["status"] and (r["status"] < 500 or r["status"] == 504
                                           or r["status"] == 503 and r["retry_after"])
    late = [r for r in replies if r["status"] == 0 or r["s"] > limit_s]
    bad = [r for r in replies if not ok_status(r)]
    out = {"bytes": len(slow), "statuses": tally(replies[:6]), "two_pages": {k: replies[6][k] for k in ("status", "s")},
           "max_s": round(max(r["s"] for r in replies), 2), "unanswered": sum(r["status"] == 0 for r in replies),
           "messages": sorted({r["message"][:160] for r in replies if r["message"]})[:3]}
    out["two_pages"]["s"] = round(out["two_pages"]["s"], 2)
    out["checks"] = [
        check("D", "every reply in time", f"{len(replies) - len(late)}/7, slowest {out['max_s']:.1f} s"
              + (f" ({out['unanswered']} unanswered)" if out["unanswered"] else ""), f"<= {limit_s:g} s", not late),
        check("D", "no 5xx but 503+Retry-After/504",
              ", ".join(f"{n}x {k}" for k, n in sorted(tally(replies).items())), "no other 5xx", not bad)]
    return out


# ----------------------------------------------------------------------------- E: slot hogging
class Hog(threading.Thread):
    """One POST of a codes file on its own connection, its answer read on this thread; `hang_up` closes it."""

    def __init__(self, host: str, port: int, path: str, body: bytes):
        super().__init__(daemon=True)
        self.conn, self.path, self.body = http.client.HTTPConnection(host, port, timeout=600), path, body
        self.status, self.retry_after, self.message, self.ended = 0, None, "", None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.conn.request("POST", self.path, body=self.body, headers={"Content-Type": MEDIA_TYPE})
            r = self.conn.getresponse()
            self.status, self.retry_after = r.status, r.getheader("retry-after")
            self.message = r.read()[:200].decode("utf-8", "replace") if r.status >= 400 else ""
        except (OSError, http.client.HTTPException) as e:
            self.message = f"hung up ({type(e).__name__})"
        self.ended = time.monotonic() - started

    def hang_up(self) -> None:
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
            except OSError:
                pass
        self.join(10)
        self.conn.close()


def max_tokens_allowed(client: httpx.Client) -> int:
    """The max_tokens maximum that /openapi.json states for /decode's query parameter (the loaded model's), else 4096."""
    try:
        params = client.get("/openapi.json").json()["paths"]["/decode"]["post"]["parameters"]
        schema = next(p["schema"] for p in params if p["name"] == "max_tokens")
        return int(next(s["maximum"] for s in schema.get("anyOf", [schema]) if "maximum" in s))
    except (httpx.HTTPError, ValueError, KeyError, StopIteration):
        return 4096


def phase_e(ctx: "Context") -> dict:
    split = urlsplit(ctx.url)
    host, port = split.hostname, split.port or 80
    with httpx.Client(base_url=ctx.url, timeout=120) as c:
        r = c.post("/encode", content=(ROOT / "examples" / "page.png").read_bytes(),
                   headers={"Content-Type": "image/png"})
        r.raise_for_status()
        page = r.json()
        most = max_tokens_allowed(c)
    doc = CodesFile(page["quantizer"], page["mode"], [np.asarray(page["codes"], dtype=np.uint8)] * 32).to_bytes()
    tries = []
    n = most
    for _ in range(4):
        print(f"phase E: 2 hogs of 32 pages, ignore_eos, max_tokens={n} ...", file=sys.stderr, flush=True)
        hogs = [Hog(host, port, f"/decode?ignore_eos=true&max_tokens={n}", doc) for _ in range(2)]
        for h in hogs:
            h.start()
        time.sleep(2.0)  # admitted into the slots, the rest queued
        if any(h.status == 422 for h in hogs):  # more than a slot holds: lower it
            for h in hogs:
                h.hang_up()
            tries.append(n)
            n //= 2
            continue
        lone = post_decode(ctx.url, {"codes": [0] * 4096, "max_tokens": 8}, 15.0)
        for h in hogs:
            h.hang_up()
        break
    else:
        raise SystemExit(f"phase E: /decode refused max_tokens {tries} with a 422")
    ok = lone["s"] <= 10 and (lone["status"] == 200 or lone["status"] == 503 and lone["retry_after"])
    return {"max_tokens": n, "refused_max_tokens": tries, "file_bytes": len(doc),
            "hogs": [{"status": h.status, "s": round(h.ended or 0, 1), "message": h.message[:160]} for h in hogs],
            "lone": lone,
            "checks": [check("E", "lone /decode behind 2 hogs", answered(lone),
                             "200 or 503+Retry-After in <= 10 s", ok)]}


# ----------------------------------------------------------------------------- the run
class Context:
    def __init__(self, url: str, pid: int, args: argparse.Namespace, watch: Watch, idle: int, nofile: int):
        self.url, self.pid, self.args, self.watch, self.idle, self.nofile = url, pid, args, watch, idle, nofile


RUNNERS = {"A": phase_a, "B": phase_b, "C": phase_c, "D": phase_d, "E": phase_e}


def scenario(url: str, pid: int, args: argparse.Namespace, nofile: int) -> dict:
    idle = idle_rss(pid)
    watch = Watch(url, pid).start()
    ctx = Context(url, pid, args, watch, idle, nofile)
    result: dict = {"url": url, "body_timeout_s": args.body_timeout_s, "request_timeout_s": args.request_timeout_s,
                    "idle_mb": round(idle / MB), "phases": {}}
    checks = []
    try:
        old = [p for p in args.phases if p in OLD_PHASES]
        if old:
            result["uploads"] = upload_phases(ctx, old)
            checks += result["uploads"]["checks"]
        for name in [p for p in args.phases if p in NEW_PHASES]:
            waited = quiet(pid)
            t0 = time.monotonic()
            phase = RUNNERS[name](ctx)
            phase["quiet_wait_s"], phase["wall_s"] = waited, round(time.monotonic() - t0, 1)
            result["phases"][name] = phase
            checks += phase["checks"]
    finally:
        watch.close()
    result["checks"] = checks
    result["pass"] = all(c["pass"] for c in checks)
    return result


def print_table(result: dict) -> None:
    print(f"idle RSS (server + children): {result['idle_mb']} MB; BODY_TIMEOUT_S {result['body_timeout_s']:g}, "
          f"REQUEST_TIMEOUT_S {result['request_timeout_s']:g}")
    uploads = result.get("uploads")
    if uploads:
        print(f"{'phase':<22} {'statuses':<44} {'max s':>6} {'health max s':>12} {'peak +MB':>9}")
        for p in uploads["phases"]:
            statuses = ", ".join(f"{n}x {k}" for k, n in sorted(p["statuses"].items()))
            print(f"{p['phase']:<22} {statuses:<44} {p['max_latency_s']:>6.2f} {p['health_max_s']:>12.2f} "
                  f"{p['peak_above_idle_mb']:>9}")
            for m in p["messages"]:
                print(f"{'':<22}   {m}")
        print(f"peak above idle: {uploads['peak_above_idle_mb']} MB; {uploads['held_above_idle_after_s']:g} s after "
              f"the last reply: {uploads['held_above_idle_mb']} MB above idle\n")
    print(f"{'phase':<22} {'check':<32} {'figure':<44} {'limit':<34} pass")
    for c in result["checks"]:
        print(f"{c['phase']:<22} {c['check']:<32} {str(c['figure']):<44} {c['limit']:<34} "
              f"{'PASS' if c['pass'] else 'FAIL'}")


def stop(proc) -> None:
    """SIGTERM (the server drains), then SIGKILL after 60 s: threads still decoding a bomb hold up its exit."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (with --pid); default: start ./serve.sh on a free port")
    ap.add_argument("--pid", type=int, help="the running server's process id (its RSS and its children's)")
    ap.add_argument("--phases", default=",".join(OLD_PHASES + NEW_PHASES),
                    help=f"comma-separated, run in this order: {', '.join(OLD_PHASES + NEW_PHASES)} (default: all)")
    ap.add_argument("--body-timeout-s", type=float, default=30.0,
                    help="the server's BODY_TIMEOUT_S (given to the server this starts); phase A's limit is it + 5 s")
    ap.add_argument("--request-timeout-s", type=float, default=30.0,
                    help="the server's REQUEST_TIMEOUT_S (given to the server this starts; its own default is 120); "
                         "phase D's limit is it + 10 s")
    ap.add_argument("--slow-counts", default="200,999", help="phase A's connection counts, one run each")
    ap.add_argument("--attack-source", default="127.0.0.2", help="the address phase A's connections come from")
    ap.add_argument("--settle-s", type=float, default=20.0, help="when to read the RSS held after the last reply")
    ap.add_argument("--pngs", type=int, default=8)
    ap.add_argument("--jpegs", type=int, default=12)
    ap.add_argument("--log", type=Path, default=Path("/tmp/hostile_load_server.log"),
                    help="where the started server's output goes")
    args = ap.parse_args()
    if bool(args.url) != bool(args.pid):
        ap.error("--url and --pid go together")
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in args.phases if p not in OLD_PHASES + NEW_PHASES]
    if unknown:
        ap.error(f"unknown phases {unknown}: choose from {', '.join(OLD_PHASES + NEW_PHASES)}")
    args.slow_counts = [int(n) for n in args.slow_counts.split(",")]
    nofile = raise_open_files()
    if "A" in args.phases and nofile < max(args.slow_counts) + 100:
        ap.error(f"the open-file limit is {nofile}: too low for {max(args.slow_counts)} connections")
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        env = {"LOG_LEVEL": "info", "BODY_TIMEOUT_S": f"{args.body_timeout_s:g}",
               "REQUEST_TIMEOUT_S": f"{args.request_timeout_s:g}"}
        proc, url, _, _ = start_server(env, ["bash", str(ROOT / "serve.sh")], args.log)
        pid = proc.pid
    try:
        result = scenario(url, pid, args, nofile)
    finally:
        if proc is not None:
            stop(proc)
    print_table(result)
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
