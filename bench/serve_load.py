"""Serving load over HTTP, measured as vLLM's benchmarks/benchmark_serving.py and SGLang's bench_serving
measure it, against any running server.

    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 1,16 --requests 64 --output-tokens 256
    python bench/serve_load.py --url URL --rate 4 --requests 200     # open loop: Poisson arrivals, 4 a second
    python bench/serve_load.py --url URL --pages scans/ --api-key K  # the codes of your own pages
    python bench/serve_load.py --url URL --random-codes              # no /encode: random (valid) codes
    python bench/serve_load.py --url URL --encode-only --clients 16 --requests 256   # /encode alone: pages/s

Each level sends --requests streamed decodes (`stream: true`, server-sent events): closed loop, each of the
--clients concurrencies in turn (that many clients, each sending its next request when its last is done),
or with --rate an open loop (arrivals a Poisson process of that rate, however many are in flight). Every
request asks for exactly --output-tokens tokens (`ignore_eos`, or `min_tokens` = `max_tokens` with
--lengths min_tokens; --lengths natural lets pages end where they end).

The codes are those POST /encode gives for --page-count pages (held-out pages rendered by
ocr_latent.training.pages, or the images and PDFs in --pages), encoded once; requests take them in turn.

Per level: output tokens/s and requests/s over the level's wall time; TTFT (to the first streamed piece of
text), TPOT (time per output token after the first: (latency - TTFT) / (tokens - 1)), ITL (between
streamed pieces: a piece is a token, or the few that complete a character or follow whitespace) and
latency, each as mean, p50, p90 and p99 in ms; errors counted by HTTP status (or the stream's error type,
or the transport error). A table, then as the last line of stdout one JSON object: every figure, the
git commit (`-dirty` when tracked files differ from it), the server's /health and the settings.

--encode-only measures POST /encode instead: each level sends --requests pages (the --page-count pages in
turn, as image files) from --clients clients; pages/s and requests/s over the level's wall time, latency
(mean, p50, p90, p99 in ms) and errors, in the same table and JSON (no TTFT, TPOT or ITL).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp", ".pdf"}
PACKED_BYTES = 2048  # 4096 four-bit codes; any 2,048 bytes are valid codes


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("OCR_LATENT_API_KEY"),
                    help="its API key (default $OCR_LATENT_API_KEY)")
    ap.add_argument("--clients", default="1,16", help="closed loop: concurrent clients, one level each (default 1,16)")
    ap.add_argument("--rate", type=float, help="open loop instead: requests a second, Poisson arrivals")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (default 64)")
    ap.add_argument("--output-tokens", type=int, default=256, help="tokens each request generates (default 256)")
    ap.add_argument("--lengths", choices=("ignore_eos", "min_tokens", "natural"), default="ignore_eos",
                    help="how the output length is fixed: ignore_eos, min_tokens = max_tokens, or not at all "
                         "(max_tokens only)")
    ap.add_argument("--pages", type=Path, help="a folder of page images or PDFs to encode (default: rendered held-out pages)")
    ap.add_argument("--random-codes", action="store_true", help="random codes instead of encoded pages (no /encode)")
    ap.add_argument("--encode-only", action="store_true", help="measure POST /encode of the pages instead of decodes")
    ap.add_argument("--page-count", type=int, default=16, help="distinct pages (codes) the requests cycle through")
    ap.add_argument("--prompt", default="free")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="random codes and arrival times (held-out pages: seed 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    args = ap.parse_args(argv)
    args.levels = [] if args.rate else [int(c) for c in args.clients.split(",")]
    if args.requests < 1 or args.output_tokens < 1 or args.page_count < 1 or any(c < 1 for c in args.levels) \
            or args.rate is not None and args.rate <= 0:
        ap.error("--requests, --output-tokens, --page-count, --clients and --rate must be positive")
    if args.encode_only and (args.random_codes or args.rate):
        ap.error("--encode-only sends pages (not --random-codes) in a closed loop (not --rate)")
    return args


# ----------------------------------------------------------------------------- the codes
def rendered_pages(n: int) -> list[tuple[bytes, str]]:
    """The first n held-out pages as PNG files (imported here: --random-codes and --pages need no fonts)."""
    from ocr_latent.training.pages import test_pages
    stream, out = test_pages(seed=2), []
    for i in range(n):
        buf = io.BytesIO()
        stream[i].image.save(buf, "PNG")
        out.append((buf.getvalue(), "image/png"))
    return out


def folder_pages(folder: Path, n: int) -> list[tuple[bytes, str]]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:n]
    if not files:
        raise SystemExit(f"serve_load: no images or PDFs in {folder}")
    return [(p.read_bytes(), "application/octet-stream") for p in files]


async def page_codes(client: httpx.AsyncClient, args) -> tuple[list[str], str | None]:
    """codes_b64 of --page-count pages (no more than there are requests), and the quantizer that made them
    (None for random codes)."""
    n = min(args.page_count, args.requests)
    if args.random_codes:
        rng = random.Random(args.seed)
        return [base64.b64encode(rng.randbytes(PACKED_BYTES)).decode() for _ in range(n)], None
    files = folder_pages(args.pages, n) if args.pages else rendered_pages(n)
    gate = asyncio.Semaphore(8)

    async def encode(data: bytes, ctype: str) -> dict:
        async with gate:
            r = await client.post("/encode", content=data, headers={"Content-Type": ctype})
        if r.status_code != 200:
            raise SystemExit(f"serve_load: /encode answered {r.status_code}: {r.text[:500]}")
        return r.json()

    answers = await asyncio.gather(*(encode(*f) for f in files))
    codes = [p["codes_b64"] for a in answers for p in a.get("pages", [a])][:n]  # a PDF: its pages
    return codes, answers[0]["quantizer"]


def decode_body(codes_b64: str, quantizer: str | None, args) -> dict:
    n = args.output_tokens
    fixed = {"ignore_eos": {"ignore_eos": True}, "min_tokens": {"min_tokens": n}, "natural": {}}[args.lengths]
    return {"codes_b64": codes_b64, "prompt": args.prompt, "max_tokens": n, "stream": True, **fixed,
            **({"quantizer": quantizer} if quantizer else {})}


# ----------------------------------------------------------------------------- one request
@dataclass
class Outcome:
    """What one streamed decode did: its times are seconds of time.perf_counter()."""
    sent: float
    pieces: list[float] = field(default_factory=list)  # when each delta event arrived
    done: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the HTTP status, the stream's error type, or the transport error
    detail: str = ""  # the error's message

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ttft(self) -> float:
        return (self.pieces[0] if self.pieces else self.done) - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


async def send_encode(client: httpx.AsyncClient, page: tuple[bytes, str]) -> Outcome:
    """One POST /encode of a page file; `tokens` counts the pages it encoded (a PDF's may be several)."""
    out = Outcome(time.perf_counter())
    try:
        r = await client.post("/encode", content=page[0], headers={"Content-Type": page[1]})
        out.done = time.perf_counter()
        if r.status_code != 200:
            out.error, out.detail = str(r.status_code), r.text[:500]
        else:
            out.tokens = len(r.json().get("pages", [None]))
    except httpx.HTTPError as e:
        out.error, out.detail = type(e).__name__, str(e)
    return out


async def send(client: httpx.AsyncClient, body: dict) -> Outcome:
    out = Outcome(time.perf_counter())
    try:
        async with client.stream("POST", "/decode", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out.error, out.detail = str(r.status_code), r.text[:500]
                return out
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event == "delta":
                        out.pieces.append(time.perf_counter())
                    elif event == "done":
                        out.done, out.tokens, out.finish_reason = time.perf_counter(), data["num_tokens"], data["finish_reason"]
                    elif event == "error":
                        out.error, out.detail = data["error"]["type"], data["error"]["message"]
            if out.done is None and out.error is None:
                out.error = "stream_ended_early"
    except httpx.HTTPError as e:
        out.error, out.detail = type(e).__name__, str(e)
    return out


# ----------------------------------------------------------------------------- a level
async def closed_loop(client: httpx.AsyncClient, bodies: list, clients: int, sender=send) -> list[Outcome]:
    """`clients` clients, each sending its next request when its last one is answered."""
    queue, outcomes = list(reversed(bodies)), []

    async def one_client():
        while queue:
            outcomes.append(await sender(client, queue.pop()))

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return outcomes


async def open_loop(client: httpx.AsyncClient, bodies: list[dict], rate: float, seed: int) -> list[Outcome]:
    """Requests at the times of a Poisson process of `rate` a second, whatever is still in flight."""
    rng, tasks = random.Random(seed), []
    for i, body in enumerate(bodies):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(send(client, body)))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict | None:
    """mean, p50, p90, p99 in ms (linear interpolation between order statistics), None without values."""
    if not values:
        return None
    v, out = sorted(values), {"mean": 1e3 * sum(values) / len(values)}
    for q in (50, 90, 99):
        x = q / 100 * (len(v) - 1)
        lo = int(x)
        out[f"p{q}"] = 1e3 * (v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo))
    return out


def summary(outcomes: list[Outcome], wall: float, args) -> dict:
    ok, failed = [o for o in outcomes if o.error is None], [o for o in outcomes if o.error is not None]
    tokens = sum(o.tokens for o in ok)
    gaps = [b - a for o in ok for a, b in zip(o.pieces, o.pieces[1:])]
    return {"requests": len(outcomes), "succeeded": len(ok), "errors": dict(Counter(o.error for o in failed)),
            "first_error": f"{failed[0].error}: {failed[0].detail}" if failed else None,
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "exact_lengths": sum(o.tokens == args.output_tokens for o in ok),
            "finish_reasons": dict(Counter(o.finish_reason for o in ok)),
            "ttft_ms": percentiles([o.ttft for o in ok]), "tpot_ms": percentiles([o.tpot for o in ok if o.tpot is not None]),
            "itl_ms": percentiles(gaps), "latency_ms": percentiles([o.latency for o in ok])}


# ----------------------------------------------------------------------------- the run
def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def encode_summary(outcomes: list[Outcome], wall: float) -> dict:
    ok, failed = [o for o in outcomes if o.error is None], [o for o in outcomes if o.error is not None]
    pages = sum(o.tokens for o in ok)
    return {"requests": len(outcomes), "succeeded": len(ok), "errors": dict(Counter(o.error for o in failed)),
            "first_error": f"{failed[0].error}: {failed[0].detail}" if failed else None, "wall_s": wall,
            "pages": pages, "pages_per_s": pages / wall, "requests_per_s": len(ok) / wall,
            "latency_ms": percentiles([o.latency for o in ok])}


def row(name: str, s: dict) -> str:
    cell = lambda p: "-" if p is None else f"{p['p50']:7.1f} {p['p90']:7.1f} {p['p99']:7.1f}"
    errors = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "0"
    return (f"{name:>10} {s['succeeded']:>4}/{s['requests']:<4} {errors:>8} {s['requests_per_s']:8.2f} "
            f"{s['output_tokens_per_s']:9.1f}  {cell(s['ttft_ms'])}  {cell(s['tpot_ms'])}  {cell(s['itl_ms'])}")


def print_table(result: dict) -> None:
    if result["encode_only"]:
        cell = lambda p: "-" if p is None else f"{p['mean']:7.1f} {p['p50']:7.1f} {p['p90']:7.1f} {p['p99']:7.1f}"
        print(f"{'level':>10} {'ok':>9} {'errors':>8} {'req/s':>8} {'pages/s':>9}  {'latency mean/p50/p90/p99 ms':>31}")
        for s in result["levels"]:
            errors = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "0"
            print(f"{s['clients']:>2} clients {s['succeeded']:>4}/{s['requests']:<4} {errors:>8} {s['requests_per_s']:8.2f} "
                  f"{s['pages_per_s']:9.2f}  {cell(s['latency_ms'])}")
        return
    print(f"{'level':>10} {'ok':>9} {'errors':>8} {'req/s':>8} {'out tok/s':>9}  {'TTFT p50/p90/p99 ms':>23}  "
          f"{'TPOT p50/p90/p99 ms':>23}  {'ITL p50/p90/p99 ms':>23}")
    for level in result["levels"]:
        print(row(f"rate {level['rate']:g}" if "rate" in level else f"{level['clients']} clients", level))


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None if args.rate else max(args.levels), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout, connect=30.0)) as client:
        try:
            health = (await client.get("/health")).json()
        except (httpx.HTTPError, ValueError) as e:
            raise SystemExit(f"serve_load: no server answers /health at {args.url}: {type(e).__name__}: {e}") from None
        if health.get("status") != "ok":
            raise SystemExit(f"serve_load: {args.url} is not ready: {health}")
        if args.encode_only:
            levels, pages = await encode_levels(client, args)
            return report(args, health, levels, "pages", pages)
        codes, quantizer = await page_codes(client, args)
        bodies = [decode_body(codes[i % len(codes)], quantizer, args) for i in range(args.requests)]
        for body in bodies[:args.warmup]:
            if (out := await send(client, body)).error:  # a refusal every request would meet: say it once
                raise SystemExit(f"serve_load: the warm-up request failed: {out.error}: {out.detail}")
        levels = []
        for clients in args.levels or [None]:
            t0 = time.perf_counter()
            if clients is None:
                outcomes = await open_loop(client, bodies, args.rate, args.seed)
            else:
                outcomes = await closed_loop(client, bodies, clients)
            levels.append({**({"rate": args.rate} if clients is None else {"clients": clients}),
                           **summary(outcomes, time.perf_counter() - t0, args)})
    return report(args, health, levels, "random" if args.random_codes else str(args.pages or "held-out pages"), len(codes))


async def encode_levels(client: httpx.AsyncClient, args) -> tuple[list[dict], int]:
    """--encode-only: each --clients level sends --requests pages, the --page-count pages in turn."""
    files = folder_pages(args.pages, args.page_count) if args.pages else rendered_pages(args.page_count)
    bodies = [files[i % len(files)] for i in range(args.requests)]
    for page in bodies[:args.warmup]:
        if (out := await send_encode(client, page)).error:
            raise SystemExit(f"serve_load: the warm-up encode failed: {out.error}: {out.detail}")
    levels = []
    for clients in args.levels:
        t0 = time.perf_counter()
        outcomes = await closed_loop(client, bodies, clients, send_encode)
        levels.append({"clients": clients, **encode_summary(outcomes, time.perf_counter() - t0)})
    return levels, len(files)


def report(args, health: dict, levels: list[dict], codes: str, pages: int) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("api_key", "levels")}
    settings.update(clients=args.levels or None, api_key=bool(args.api_key))  # the levels run; never the key itself
    return {"commit": git_commit(), "settings": settings, "encode_only": args.encode_only,
            "server": {k: health.get(k) for k in ("model", "revision", "device", "quantizer", "mode")},
            "codes": codes, "pages": pages, "levels": levels}


def main(argv=None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
