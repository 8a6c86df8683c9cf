"""Throughput of the Ray backend on this machine: pages/s through /encode then /decode (max_tokens tokens),
`clients` at once, against a service already running at URL. Prints one JSON line.

    BACKEND=ray DECODE_REPLICAS=2 TORCH_THREADS=1 REPLICA_CPUS=0.5 ./serve.sh &
    .venv/bin/python deploy/measure.py http://127.0.0.1:8000 --pages 32 --clients 16 --max-tokens 48
"""
import argparse
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from ocr_latent.training.pages import test_pages

ap = argparse.ArgumentParser()
ap.add_argument("url")
ap.add_argument("--pages", type=int, default=32)
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--max-tokens", type=int, default=48)
args = ap.parse_args()
stream = test_pages(seed=3)
bodies = []
for i in range(args.pages):
    buf = io.BytesIO()
    stream[i].image.save(buf, "PNG")
    bodies.append(buf.getvalue())


def page(body: bytes) -> None:
    with httpx.Client(base_url=args.url, timeout=600) as c:
        codes = c.post("/encode", content=body, headers={"Content-Type": "image/png"}).raise_for_status().json()
        c.post("/decode", json={"codes_b64": codes["codes_b64"], "max_tokens": args.max_tokens}).raise_for_status()


page(bodies[0])  # warm
t0 = time.perf_counter()
with ThreadPoolExecutor(args.clients) as pool:
    list(pool.map(page, bodies))
elapsed = time.perf_counter() - t0
print(json.dumps({"pages": args.pages, "clients": args.clients, "max_tokens": args.max_tokens,
                  "seconds": round(elapsed, 2), "pages_per_s": round(args.pages / elapsed, 2)}))
