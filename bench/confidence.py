"""How well `confidence` and `fidelity` say how far to trust a reading and a page's codes, as served.

    nice -n 5 .venv/bin/python bench/confidence.py                        # 22 pages of each of 12 kinds: 264
    .venv/bin/python bench/confidence.py --per-kind 8 --kinds small,ordinary,blank --min-confidence 0.3

Starts the server (server.py, the embedded default) on a free loopback port, renders held-out pages of every
kind the project reads (training.pages.REPORTED_KINDS, blank pages and pictures without text) from the test
split's documents (the calibration, `train.py confidence`, fits on the validation split's), and for each page:
POST /encode (its codes and fidelity), POST /decode of those codes (text, finish_reason, confidence), both
16 at a time; in process, the reading of the page uncompressed. Then prints, and as its last line one JSON
object:
  - AUROC of confidence for telling pages read at CER <= 0.25 from pages read at CER >= 0.5, Spearman between
    confidence and -CER, and a reliability table (confidence decile -> pages, mean confidence, mean CER);
  - Spearman between 1 - fidelity and the CER of the reading through the codes against the uncompressed one;
  - the early stop: the same decodes with min_confidence, their time by kind against the decodes without it,
    and the readable pages (CER <= 0.25 without it) that it stopped;
  - one threshold: the share of pages read at CER >= 0.5 flagged below it, and of pages at CER <= 0.1.
CER is edit distance over reference characters; for a page without text, the characters read (0 when none).
"""
from __future__ import annotations

import argparse
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from throughput import start_server, stop_server
from ocr_latent.serving.pipeline import load_pipeline
from ocr_latent.training.confidence import NO_TEXT, calibration_pages, read
from ocr_latent.training.pages import REPORTED_KINDS
from ocr_latent.training.reading_metrics import cer


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, ties averaged."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def spearman(a, b) -> float:
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


def auroc(scores_pos, scores_neg) -> float:
    """P(a positive scores above a negative), ties half."""
    pos, neg = np.asarray(scores_pos, float)[:, None], np.asarray(scores_neg, float)[None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size))


def post_all(url: str, bodies: list[dict], path: str, concurrency: int = 16, **kw) -> tuple[list[dict], list[float]]:
    with httpx.Client(base_url=url, timeout=600) as client:
        def one(body):
            t0 = time.perf_counter()
            r = client.post(path, **body, **kw)
            r.raise_for_status()
            return r.json(), time.perf_counter() - t0
        with ThreadPoolExecutor(concurrency) as pool:
            out = list(pool.map(one, bodies))
    return [o for o, _ in out], [t for _, t in out]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-kind", type=int, default=22)
    ap.add_argument("--kinds", default=",".join([*REPORTED_KINDS, *NO_TEXT]))
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--min-confidence", type=float, default=0.3, help="the early stop's threshold")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    pages = calibration_pages(args.per_kind, 1, args.seed, args.kinds.split(","))
    kinds = np.array([k for k, _, _ in pages])
    pngs = []
    for _, image, _ in pages:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        pngs.append(buf.getvalue())
    proc, url, _, _ = start_server({"DECODE_SLOTS": "16", "REQUEST_TIMEOUT_S": "900"})  # 264 pages queue at once
    try:
        encoded, _ = post_all(url, [{"content": p} for p in pngs], "/encode", headers={"Content-Type": "image/png"})
        bodies = [{"json": {"codes_b64": e["codes_b64"], "max_tokens": args.max_tokens}} for e in encoded]
        t0 = time.perf_counter()
        decoded, _ = post_all(url, bodies, "/decode")
        plain_s = time.perf_counter() - t0
        stop_bodies = [{"json": {**b["json"], "min_confidence": args.min_confidence}} for b in bodies]
        t0 = time.perf_counter()
        stopped, _ = post_all(url, stop_bodies, "/decode")
        stop_s = time.perf_counter() - t0
        by_kind_s = {}
        for kind in dict.fromkeys(kinds):  # each kind alone, with and without the early stop: where time goes
            chosen = [i for i in range(len(pages)) if kinds[i] == kind]
            times = []
            for group in (bodies, stop_bodies):
                t0 = time.perf_counter()
                post_all(url, [group[i] for i in chosen], "/decode")
                times.append(time.perf_counter() - t0)
            by_kind_s[str(kind)] = {"without_s": round(times[0], 2), "with_s": round(times[1], 2)}
    finally:
        stop_server(proc)
    pipe = load_pipeline()
    plain = [r.text for r in read(pipe, [im for _, im, _ in pages], args.max_tokens, through_codes=False)]

    truths = [t for _, _, t in pages]
    cers = np.array([cer(d["text"], t) for d, t in zip(decoded, truths)])
    conf = np.array([d["confidence"] for d in decoded], float)
    fid = np.array([e["fidelity"] for e in encoded], float)
    drift = np.array([cer(d["text"], p) for d, p in zip(decoded, plain)])
    good, bad = cers <= 0.25, cers >= 0.5
    result = {"pages": len(pages), "kinds": sorted(set(kinds.tolist())), "max_tokens": args.max_tokens,
              "faithful": int(good.sum()), "garbage": int(bad.sum()),
              "auroc": auroc(conf[good], conf[bad]) if good.any() and bad.any() else None,
              "spearman_confidence": spearman(conf, -cers),
              "spearman_fidelity": spearman(1 - fid, drift)}
    deciles = np.minimum((ranks(conf) * 10 // len(conf)).astype(int), 9)
    result["reliability"] = [{"decile": d, "pages": int((deciles == d).sum()),
                              "confidence": round(float(conf[deciles == d].mean()), 3),
                              "cer": round(float(cers[deciles == d].mean()), 3)} for d in range(10) if (deciles == d).any()]
    t = args.min_confidence
    result["threshold"] = {"at": t, "flags_cer_ge_0.5": float((conf[bad] < t).mean()) if bad.any() else None,
                           "flags_cer_le_0.1": float((conf[cers <= 0.1] < t).mean()) if (cers <= 0.1).any() else None}
    low = np.array([s["finish_reason"] == "low_confidence" for s in stopped])
    result["early_stop"] = {"min_confidence": t, "all_pages_s": round(plain_s, 1), "with_stop_s": round(stop_s, 1),
                            "stopped": int(low.sum()), "readable_stopped": int((low & good).sum()),
                            "garbage_stopped": int((low & bad).sum()), "by_kind": by_kind_s}
    print(f"{len(pages)} pages ({', '.join(result['kinds'])}); read at CER <= 0.25: {good.sum()}, >= 0.5: {bad.sum()}")
    print(f"confidence: AUROC {result['auroc']:.3f}, Spearman(confidence, -CER) {result['spearman_confidence']:.3f}")
    print(f"fidelity:   Spearman(1 - fidelity, CER codes vs uncompressed) {result['spearman_fidelity']:.3f}")
    print("confidence decile  pages  mean confidence  mean CER")
    for row in result["reliability"]:
        print(f"{row['decile']:>17}  {row['pages']:>5}  {row['confidence']:>15.3f}  {row['cer']:>8.3f}")
    th = result["threshold"]
    print(f"below {t}: {th['flags_cer_ge_0.5']} of pages at CER >= 0.5, {th['flags_cer_le_0.1']} of pages at CER <= 0.1")
    es = result["early_stop"]
    print(f"early stop at {t}: all pages {es['all_pages_s']} s -> {es['with_stop_s']} s; stopped {es['stopped']} "
          f"(garbage {es['garbage_stopped']}, readable {es['readable_stopped']})")
    for kind, row in by_kind_s.items():
        print(f"  {kind:<14} {row['without_s']:>7.1f} s -> {row['with_s']:>7.1f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
