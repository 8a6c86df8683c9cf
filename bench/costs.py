"""What the decode worker spends per request and per step on this CPU, in-process (no HTTP): the inputs
of the batching ratio that bench/throughput.py measures end to end.

    .venv/bin/python bench/costs.py          # ~1 minute on the 2-core box; medians of interleaved rounds

Prints: the prompt's decoder inputs (quantizer decompressor), a prefill of 1, 2 and 4 prompts, a decode
step at 1 and 16 rows (~400 positions), the repetition rule per sequence and token, and a small GEMM
from the thread that owns the process's only OpenMP team against one from a second thread once another
team exists (the engine keeps every torch op on its one worker thread because of the latter).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import Counter

import torch

from pages import PageSpec, PageStream, load_corpus, split_documents
from pipeline import load_pipeline


def median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main(rounds: int = 3) -> None:
    pipe = load_pipeline()
    stream = PageStream(split_documents(load_corpus())["test"], PageSpec(augment=False), seed=2)
    codes = pipe.encode([stream[i].image for i in range(16)])
    inputs = [pipe.decode_inputs(c, "free") for c in codes]
    gen = pipe.new_generator(16)

    def prefill(k):
        for s in gen.add(inputs[:k], [512] * k):
            gen.drop(s)

    steppers = {}
    for rows in (1, 16):  # fixed batches ~400 positions long, the rule off: only the step is timed
        g = steppers[rows] = pipe.new_generator(16)
        g.rule = None
        g.add(inputs[:rows], [4000] * rows)
        for _ in range(110):
            g.step()
    prefill(4)
    for r in range(rounds):
        cells = [f"decode_inputs {median_ms(lambda: pipe.decode_inputs(codes[0], 'free'), 10):.1f} ms"]
        cells += [f"prefill {k} {median_ms(lambda: prefill(k), 8):.1f} ms" for k in (1, 2, 4)]
        cells += [f"step {rows} rows {median_ms(steppers[rows].step, 15):.2f} ms" for rows in (1, 16)]
        print(", ".join(cells), flush=True)

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
