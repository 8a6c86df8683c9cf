"""How much of the page a fresh reading head gets out of a run's vision tokens, by how many text lines a token
holds. It trains an order head (train.py's: linear-GELU-linear, the characters of each token in reading order,
`--slot-lines` groups, tokens holding two or more lines weighted by `--two-line-weight`) on the frozen tower
features a decoder stage cached (RUN/features), then reads with it the held-out tail of that cache and the
pages bench/tower_accuracy.py reads (held-out documents), through the run's towers. A head of its own reading
well above the towers' trained head says the information is in the tokens and the readout falls short.

    python bench/token_probe.py runs/v4-dec12 --field-targets --line-targets --slot-lines 2 --two-line-weight 4
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from ocr_latent.checkpoint import load_model
from ocr_latent.serving.pipeline import base_fingerprint
from ocr_latent.training.losses import lines_held, order_targets
from ocr_latent.training.nano import model_charset
from ocr_latent.training.pages import (FIELD_SHIFT, PAGE_KINDS, PageStream, level_pages, load_corpus, on_lines,
                                       split_documents, training_documents)

HELD = {1: "1 text line", 2: "2 text lines"}  # how many lines a token holds, as reported; more: "3+ text lines"


def cached_pages(run: Path, model):
    """(features [T, D], page) for every page of the run's feature cache, in cache order; the cache must be of
    the run's towers (features.shard_key)."""
    shards = sorted((run / "features").glob("features-*.safetensors"))
    if not shards:
        raise SystemExit(f"{run} has no feature cache: give a decoder stage's run (train.py base --stage decoder)")
    towers = base_fingerprint(model)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            key = f.metadata() or {}
        if key.get("base_fingerprint") != towers:
            raise SystemExit(f"{shard} was cached from other towers than {run}'s: rerun its decoder stage to rebuild it")
        stream = PageStream(training_documents("documents" in key), PAGE_KINDS[key.get("page_kind", "small")],
                            seed=int(key["stream_seed"]))
        feats = load_file(str(shard))["features"]
        for i in range(len(feats)):
            yield feats[i], stream[int(key["first_page"]) + i]


class Targets:
    """A head's targets for a page: each token's characters in reading order, and how many lines it holds."""

    def __init__(self, charset: str, slots: int, lines: int, field_targets: bool, line_targets: bool):
        self.charset, self.slots, self.lines = charset, slots, lines
        self.shift = FIELD_SHIFT if field_targets else 0.0
        self.view = on_lines if line_targets else (lambda page: page)

    def __call__(self, page) -> tuple[torch.Tensor, torch.Tensor]:
        page = self.view(page)
        return (torch.from_numpy(order_targets(page, 16, self.slots, self.charset, self.shift, self.lines)),
                torch.from_numpy(lines_held(page, 16, self.charset, self.shift)))


def tally(read: torch.Tensor, target: torch.Tensor, held: torch.Tensor, empty: int, counts: dict) -> None:
    """Add the occupied slots of tokens [N, slots] read right, by the lines their token holds, to counts."""
    occupied = target != empty
    for n in held[occupied.any(-1)].unique().tolist():
        rows = held == n
        row = counts.setdefault(HELD.get(n, "3+ text lines"), [0, 0])
        row[0] += int((read[rows] == target[rows])[occupied[rows]].sum())
        row[1] += int(occupied[rows].sum())


def report(counts: dict) -> dict:
    return {key: {"accuracy": round(right / total, 3), "slots": total} for key, (right, total) in sorted(counts.items())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a decoder stage's run directory (its towers and features/)")
    ap.add_argument("--held-out", type=int, default=256, help="the cache's last pages, read and not trained on")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=1024, help="tokens holding text a step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=512, help="the head's hidden width (train.py's --head-hidden)")
    ap.add_argument("--slots", type=int, default=16, help="characters read per token (train.py's --order-slots)")
    ap.add_argument("--slot-lines", type=int, default=1)
    ap.add_argument("--two-line-weight", type=float, default=1.0)
    ap.add_argument("--field-targets", action="store_true", help="targets as train.py --field-targets has them")
    ap.add_argument("--line-targets", action="store_true", help="targets as train.py --line-targets has them")
    ap.add_argument("--level", default="0", help="curriculum level of the held-out documents' pages, or small")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--seed", type=int, default=21, help="page stream of the validation split")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    run = Path(args.run)
    model = load_model(run)
    model.encoder.eval()
    charset = model_charset(model)
    empty, classes = len(charset), len(charset) + 1
    targets = Targets(charset, args.slots, args.slot_lines, args.field_targets, args.line_targets)

    feats, target, held = [], [], []
    for f, page in tqdm(cached_pages(run, model), desc="cached pages", leave=False):
        t, h = targets(page)
        feats.append(f), target.append(t), held.append(h)
    if len(feats) <= args.held_out:
        raise SystemExit(f"the cache holds {len(feats)} pages: hold out fewer than that (--held-out)")
    split = len(feats) - args.held_out
    # only the tokens holding text, page by page (empty tokens teach nothing a page's text needs; a whole
    # cache of tokens would be copied once more before the selection)
    with_text = [n > 0 for n in held[:split]]
    x = torch.cat([f[keep] for f, keep in zip(feats, with_text)])
    y = torch.cat([t[keep] for t, keep in zip(target, with_text)])
    h = torch.cat([n[keep] for n, keep in zip(held, with_text)])

    D = x.shape[-1]
    head = torch.nn.Sequential(torch.nn.Linear(D, args.hidden), torch.nn.GELU(), torch.nn.Linear(args.hidden, args.slots * classes))
    opt = torch.optim.AdamW(head.parameters(), args.lr, weight_decay=0.01)
    for step in tqdm(range(args.steps), desc="head", leave=False):
        for group in opt.param_groups:  # a short warm-up, then cosine to zero
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        b = torch.randint(len(x), (args.batch,))
        weight = torch.where(h[b] >= 2, args.two_line_weight, 1.0)[:, None].expand(-1, args.slots)
        loss = F.cross_entropy(head(x[b].float()).reshape(-1, classes), y[b].flatten(), reduction="none")
        loss = (loss * weight.flatten()).sum() / weight.sum()
        opt.zero_grad(), loss.backward(), opt.step()

    read = lambda f: head(f.float()).reshape(-1, args.slots, classes).argmax(-1)
    out = {}
    with torch.no_grad():
        cache_counts: dict = {}
        for f, t, n in zip(feats[split:], target[split:], held[split:]):
            tally(read(f), t, n, empty, cache_counts)
        out["held-out cache pages"] = report(cache_counts)
        val_counts: dict = {}
        for page in level_pages(split_documents(load_corpus())["val"], args.level, args.pages, args.seed):
            t, n = targets(page)
            tally(read(model.encoder.encode_images([page.image], "base")[0]), t, n, empty, val_counts)
        out[f"level {args.level}, held-out documents"] = report(val_counts)
    for where, rows in out.items():
        for key, row in rows.items():
            print(f"{where:>34}, {key}: {row['accuracy']:.3f} of {row['slots']} slots")
    print(json.dumps({"run": str(run), "trained_on": split, "steps": args.steps, "hidden": args.hidden,
                      "slot_lines": args.slot_lines, "two_line_weight": args.two_line_weight, "accuracy": out}))


if __name__ == "__main__":
    main()
