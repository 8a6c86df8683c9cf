"""What a training run's towers read, by glyph size: the share of occupied reading-order slots its order
head reads right from each vision token (64 px of the view) and its patch head from each 16 px patch of
SAM's neck, for glyphs under and over a size in the 1024 px view (a 512 px page is scaled x2 into it).
The heads are the run's own (train_state.safetensors of an encoder or joint stage, or of a run made with
--heads-from); the pages are held-out pages of a curriculum level (pages.level_pages). The token head is
also measured by how far down its 64 px square a glyph's centre lies (a token's convs see 64 px above and
left of its square and 16 px below and right: pages.FIELD_SHIFT); a run trained with --field-targets or
--line-targets or --slot-lines is measured on the targets it learned. It is also measured by how many text
lines a glyph's token holds, and with --edge-slack letting a glyph near a token row's edge count on the side
the head reads better (either_side_target).

    python bench/tower_accuracy.py runs/v4-enc7 --level 0 --pages 24 --split-at 48
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ocr_latent.checkpoint import load_model
from ocr_latent.training.losses import lines_held, order_targets, slot_positions
from ocr_latent.training.nano import model_charset
from ocr_latent.training.pages import FIELD_SHIFT, across_edges, level_pages, load_corpus, on_lines, split_documents, token_cell


def saved_head(state: dict[str, torch.Tensor], name: str) -> torch.nn.Module:
    """A dense-loss head as train.py saves it: linear, or linear-GELU-linear."""
    own = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
    if not own:
        raise SystemExit(f"the run has no trained {name} head: measure an encoder stage's run")
    linear = lambda w: torch.nn.Linear(w.shape[1], w.shape[0])
    head = (torch.nn.Sequential(linear(own["0.weight"]), torch.nn.GELU(), linear(own["2.weight"]))
            if "0.weight" in own else linear(own["weight"]))
    head.load_state_dict(own)
    return head


def by_place(page, read: torch.Tensor, charset: str, shift: float, lines: int):
    """(where a glyph lies, whether the token head read it; `read`: its [256, slots] class ids) for each
    glyph with a slot of the token head, where twice: how far down its 64 px square its centre lies (16 px
    bands), and how many text lines its token holds."""
    held = lines_held(page, 16, charset, shift)
    for box, cell, slot in slot_positions(page, 16, read.shape[1], charset, shift, lines):
        band = token_cell(page, box, 64) // 64 % 4  # the 16 px row of the square the centre lies in
        right = int(read[cell, slot]) == charset.index(box[0])
        yield f"centre {16 * band}-{16 * band + 16} px down its square", right
        yield {1: "1 text line", 2: "2 text lines"}.get(int(held[cell]), "3+ text lines") + " in its token", right


def either_side_target(page, read: torch.Tensor, target: torch.Tensor, charset: str, shift: float, slack: float,
                       lines: int) -> torch.Tensor:
    """The token head's targets [256, slots] (`target`, as order_targets gives them) with the glyphs within
    `slack` (a fraction of a square) of the edge between two token rows counted on the side the head reads
    with fewer errors (`read`: its [256, slots] class ids). Glyphs are moved across (pages.across_edges) a
    column at a time: a moved glyph's two cells, and every cell chained to them through other moved glyphs,
    change sides together."""
    across, moved = across_edges(page, 16, shift, slack)
    owner = list(range(256))  # union-find over cells

    def root(k: int) -> int:
        while owner[k] != k:
            owner[k] = owner[owner[k]]
            k = owner[k]
        return k

    for i in moved:
        owner[root(token_cell(page, page.char_boxes[i], 16, shift))] = root(token_cell(across, across.char_boxes[i], 16, shift))
    target_across = torch.from_numpy(order_targets(across, 16, read.shape[1], charset, shift, lines))
    wrong = lambda t: ((read != t) & (t != len(charset))).sum(-1)  # [256]
    group = torch.tensor([root(c) for c in range(256)])
    errors = lambda t: torch.zeros(256, dtype=torch.long).scatter_add(0, group, wrong(t))[group]
    return torch.where((errors(target_across) < errors(target))[:, None], target_across, target)


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a training run's directory (train.py base --out)")
    ap.add_argument("--level", default="0", help="curriculum level, or small (nano v1's pages)")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--seed", type=int, default=21, help="page stream of the validation split")
    ap.add_argument("--split-at", type=int, default=48, help="glyph size (px in the view) between the two bands")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--edge-slack", type=float, default=0.0, help="also count a glyph within this many px (of the 1024 px "
                    "view) of the edge between two token rows on the side the head reads better")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.run)
    model.encoder.eval()
    charset, state = model_charset(model), load_file(str(Path(args.run) / "train_state.safetensors"))
    classes = len(charset) + 1
    heads = {"token": (saved_head(state, "order"), 16), "patch": (saved_head(state, "patch"), 64)}
    meta = Path(args.run) / "train_meta.json"
    trained = json.loads(meta.read_text()).get("args", {}) if meta.exists() else {}  # the targets the run's heads learned
    shift = FIELD_SHIFT if trained.get("field_targets") else 0.0
    token_view = on_lines if trained.get("line_targets") else (lambda page: page)
    lines, slack = trained.get("slot_lines", 1), args.edge_slack * 16 / 1024
    necks = []
    model.encoder.sam_model.neck.register_forward_hook(lambda module, inputs, out: necks.append(out))
    counts: dict[str, list[int]] = {}
    for page in level_pages(split_documents(load_corpus())["val"], args.level, args.pages, args.seed):
        features = model.encoder.encode_images([page.image], "base")[0]
        inputs = {"token": features, "patch": necks.pop()[0].flatten(1).T}
        view_size = page.font_size * 1024 / max(page.image.size)
        band = f"under {args.split_at} px" if view_size < args.split_at else f"{args.split_at} px and over"
        token_page, reads, targets = token_view(page), {}, {}
        for name, (head, grid) in heads.items():
            logits = head(inputs[name])
            slots = logits.shape[-1] // classes
            reads[name] = logits.reshape(-1, slots, classes).argmax(-1)
            targets[name] = torch.from_numpy(order_targets(token_page, grid, slots, charset, shift, lines) if name == "token"
                                             else order_targets(page, grid, slots, charset))
        if slack:  # a glyph near a row's edge counted on the side the head reads better
            reads["token either side"] = reads["token"]
            targets["token either side"] = either_side_target(token_page, reads["token"], targets["token"], charset, shift,
                                                              slack, lines)
        for name, target in targets.items():
            occupied = target != len(charset)
            tally = counts.setdefault(f"{name}, {band}", [0, 0])
            tally[0] += int((reads[name] == target)[occupied].sum())
            tally[1] += int(occupied.sum())
        for part, right in by_place(token_page, reads["token"], charset, shift, lines):
            tally = counts.setdefault(f"token, {part}", [0, 0])
            tally[0], tally[1] = tally[0] + right, tally[1] + 1
    out = {key: {"accuracy": round(right / total, 3), "slots": total} for key, (right, total) in sorted(counts.items())}
    for key, row in out.items():
        print(f"{key:>36}: {row['accuracy']:.3f} of {row['slots']} slots")
    print(json.dumps({"run": args.run, "level": args.level, "pages": args.pages, "seed": args.seed,
                      "edge_slack_px": slack * 1024 / 16, "accuracy": out}))


if __name__ == "__main__":
    main()
