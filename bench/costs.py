"""What the decode worker spends per request and per step on this CPU, in-process (no HTTP): the inputs
of the batching ratio that bench/throughput.py measures end to end.

    .venv/bin/python bench/costs.py          # ~1 minute on the 2-core box; medians of interleaved rounds

Prints: the prompt's decoder inputs (quantizer decompressor), a prefill of 1, 2 and 4 prompts, a decode
step at 1 and 16 rows (~400 positions), the same steps with the attention over the cache left out
(timing only: what reading the cached keys and values costs a step), then that attention alone (16 rows,
~420 positions, every layer) with fp32 keys/values and with bf16 ones, against the box's memory bandwidth (a sum
over 400 MB), the repetition rule per sequence and token, and a small GEMM
from the thread that owns the process's only OpenMP team against one from a second thread once another
team exists (the engine keeps every torch op on its one worker thread because of the latter).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import Counter

import torch

from ocr_latent import decoder
from ocr_latent.training.pages import test_pages
from ocr_latent.serving.pipeline import load_pipeline


def median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def median_step_ms(gen, n: int, read_cache: bool = True) -> float:
    """A step's median time; without `read_cache` each layer skips its attention over the cache (the query
    stands in for its output: projections, RoPE and the cache write still run). For timing only."""
    attend_cached = decoder.attend_cached
    if not read_cache:
        decoder.attend_cached = lambda q, k, v, mask: q
    try:
        return median_ms(gen.step, n)
    finally:
        decoder.attend_cached = attend_cached


def cache_reads(pipe, rows: int = 16, positions: int = 420) -> None:
    """A decode step's attention over the cache alone (decoder.attend_cached over keys/values laid out as
    KVCache lays them out), in fp32 and as a bf16 cache would run it, against how fast this box streams
    memory."""
    cfg = pipe.model.decoder.cfg
    layers, heads, d = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(rows, heads, 1, d)
    mask = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    size = 2 * layers * rows * heads * positions * d

    def attend(k, v):
        for layer in range(layers):
            decoder.attend_cached(q.to(k.dtype), k[layer, :, :, :positions], v[layer, :, :, :positions], mask)

    cells = []
    for dtype in (torch.float32, torch.bfloat16):
        k, v = (torch.randn(layers, rows, heads, positions + 1, d).to(dtype) for _ in range(2))
        attend(k, v)
        ms = median_ms(lambda: attend(k, v), 30)
        cells.append(f"{str(dtype)[6:]} {ms:.2f} ms ({size * k.element_size() / ms / 1e6:.1f} GB/s)")
    big, threads = torch.randn(100_000_000), torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            big.sum()
            cells.append(f"sum over 400 MB on {n} thread(s) {4e8 / median_ms(big.sum, 5) / 1e6:.1f} GB/s")
    finally:
        torch.set_num_threads(threads)
    print(f"attention over the cache alone ({rows} rows, {positions} positions, {layers} layers): " + ", ".join(cells))


def main(rounds: int = 3) -> None:
    pipe = load_pipeline()
    stream = test_pages(seed=2)
    codes = pipe.encode([stream[i].image for i in range(16)])
    inputs = [pipe.decode_inputs(c, "free") for c in codes]
    gen = pipe.new_generator(16)

    def prefill(k):
        for s in gen.add(inputs[:k], [512] * k):
            gen.drop(s)

    steppers = {}
    for rows in (1, 16):  # fixed batches ~400 positions long, the rule off: only the step is timed
        g = steppers[rows] = pipe.new_generator(16)
        g.rule, g.eos_id = None, -1  # every row runs every step
        g.add(inputs[:rows], [4000] * rows)
        for _ in range(110):
            g.step()
    prefill(4)
    for r in range(rounds):
        cells = [f"decode_inputs {median_ms(lambda: pipe.decode_inputs(codes[0], 'free'), 10):.1f} ms"]
        cells += [f"prefill {k} {median_ms(lambda: prefill(k), 8):.1f} ms" for k in (1, 2, 4)]
        cells += [f"step {rows} rows {median_step_ms(steppers[rows], 15):.2f} ms "
                  f"({median_step_ms(steppers[rows], 15, read_cache=False):.2f} without reading the cache)" for rows in (1, 16)]
        print(", ".join(cells), flush=True)

    cache_reads(pipe)
    rule, seqs, n = pipe.rule, gen.generate(inputs, [512] * 16), 0
    t0 = time.perf_counter()
    for s in seqs:  # replayed: the rule's three calls per token, as Generator._choose makes them
        t, grams = [], Counter()
        for token in s.tokens:
            rule.banned(t)
            t.append(token)
            rule.track(grams, t)
            rule.looping(t, grams)
            n += 1
    print(f"repetition rule: {1e6 * (time.perf_counter() - t0) / n:.1f} us per sequence and token")

    a, w, out = torch.randn(16, 256), torch.randn(256, 256), []
    mm = lambda: out.append(median_ms(lambda: a @ w, 2000))
    mm()  # this (main) thread owns a team by now
    thread = threading.Thread(target=mm)
    thread.start()
    thread.join()
    print(f"16x256 @ 256x256: {1e3 * out[0]:.0f} us from the team's thread, {1e3 * out[1]:.0f} us from a second thread")


if __name__ == "__main__":
    main()
