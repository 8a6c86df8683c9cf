"""Which of a reader's decoder heads look where the text is: for every head of every layer, the share of the
characters of held-out pages (teacher-forced, as in training) at whose position the head attends most to the
vision token showing the character that position predicts (losses.char_cells, placed as a run's towers learned:
--field-targets, --line-targets). A decoder learns such a pointer by itself in a late layer; train.py's
--pointer-weight guides chosen heads to it. The best head of each layer is also measured on the lines that share
a row of vision tokens with another line and on the rest (pages.lines_sharing_a_row): where the pointer fails.
With --second-lines the targets are a line pointer's (train.py --line-pointer-heads): the token for the characters
of the lower of two lines sharing it, BOS for all others, and the split is by target.

    python bench/pointer_heads.py runs/v4-dec14 --level 0 --pages 16 --field-targets --line-targets
    python bench/pointer_heads.py runs/v4r-dec-line --level 0 --pages 16 --field-targets --line-targets --second-lines
"""
from __future__ import annotations

import argparse
import json

import torch

from ocr_latent.checkpoint import load_model
from ocr_latent.training.losses import AT_BOS, AttentionTap, Pointer, char_cells, pointer_targets, teacher_forced_logits
from ocr_latent.training.manifest import ROOT
from ocr_latent.training.nano import model_charset, spells_by_character
from ocr_latent.training.pages import (FIELD_SHIFT, LINE_KINDS, level_pages, lines_sharing_a_row, load_corpus, on_lines,
                                       split_documents)

TARGETS = ("the lower line's token", "BOS")  # --second-lines


@torch.no_grad()
def pointer_hits(model, pages, shift: float, line_targets: bool, second_lines: bool = False
                 ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """({"all" or a kind: [layers, heads] how many of its characters each head points at right}, {the same: how
    many characters}). The kinds are the LINE_KINDS, or with `second_lines` (a line pointer's targets) TARGETS."""
    kinds = TARGETS if second_lines else LINE_KINDS
    dec, charset = model.decoder, model_charset(model)
    L, H = dec.cfg.num_hidden_layers, dec.cfg.num_attention_heads
    hits = {name: torch.zeros(L, H) for name in ("all", *kinds)}
    counts = dict.fromkeys(hits, 0)
    for i in range(0, len(pages), 4):
        chunk = pages[i:i + 4]
        view = [on_lines(p) if line_targets else p for p in chunk]
        cells = [char_cells(v, 16, shift, charset, second_lines) for v in view]
        feats = model.encoder.encode_images([p.image for p in chunk], "base")
        with AttentionTap(dec, set(range(L))) as tap:
            _, target = teacher_forced_logits(model, [dec.layout_image(f) for f in feats], [p.text for p in chunk])
        pointer = Pointer([], cells, 16)
        for row, page in enumerate(chunk):
            queries, keys = pointer_targets(pointer, target, row)
            shares = lines_sharing_a_row(page)
            aimed = [(k, c) for k, c in enumerate(cells[row]) if c >= 0 or c == AT_BOS]  # as pointer_targets
            label = [(TARGETS[c == AT_BOS] if second_lines else LINE_KINDS[not shares[page.text[:k].count("\n")]])
                     for k, c in aimed]
            kind = {name: torch.tensor([lab == name for lab in label], dtype=torch.bool) for name in kinds}
            for layer in range(L):
                for head in range(H):
                    right = tap.log_attention(layer, head, row, queries).argmax(-1) == keys
                    hits["all"][layer, head] += int(right.sum())
                    for name in kinds:
                        hits[name][layer, head] += int(right[kind[name]].sum())
            counts["all"] += len(keys)
            for name in kinds:
                counts[name] += int(kind[name].sum())
    return hits, counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "weights" / "nano"), help="model directory")
    ap.add_argument("--level", default="0", help="curriculum level of the held-out pages; small: nano v1's pages")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--seed", type=int, default=21, help="page stream of the validation split")
    ap.add_argument("--field-targets", action="store_true", help="characters placed as towers trained with it see them")
    ap.add_argument("--line-targets", action="store_true", help="characters placed by their line's middle")
    ap.add_argument("--second-lines", action="store_true",
                    help="a line pointer's targets: the token for a shared token's lower line, else BOS")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    pages = level_pages(split_documents(load_corpus())["val"], args.level, args.pages, args.seed)
    # a page the tokenizer cannot spell character by character (a letter outside its charset) has no targets
    spelled = [p for p in pages if spells_by_character(model, p.text)]
    if len(spelled) < len(pages):
        print(f"left out {len(pages) - len(spelled)} of {len(pages)} pages: characters the tokenizer cannot write")
    if not spelled:
        raise SystemExit("no page left: the model's tokenizer cannot write these pages' characters")
    pages = spelled
    hits, counts = pointer_hits(model, pages, FIELD_SHIFT if args.field_targets else 0.0, args.line_targets,
                                args.second_lines)
    kinds = [name for name in hits if name != "all"]  # pointer_hits' split: LINE_KINDS, or TARGETS with --second-lines
    share = {name: h / max(1, counts[name]) for name, h in hits.items()}
    print(f"level {args.level}, {len(pages)} pages, {counts['all']} characters; share each head points at right "
          f"(rows: layers, columns: heads):")
    for layer, row in enumerate(share["all"].tolist()):
        print(f"  layer {layer}: " + "  ".join(f"{a:.3f}" for a in row))
    # a head resting on BOS (a common sink) is right at most of a line pointer's targets: rank by both kinds
    rank = (share[TARGETS[0]] + share[TARGETS[1]]) / 2 if args.second_lines else share["all"]
    best = {}
    for layer in range(share["all"].shape[0]):
        head = int(rank[layer].argmax())
        best[f"layer {layer}, head {head}"] = {name: {"chars": counts[name], "accuracy": round(float(share[name][layer, head]), 3)
                                                      if counts[name] else None} for name in ("all", *kinds)}
        print(f"  layer {layer}'s best, head {head}: " + ", ".join(
            f"{name} {share[name][layer, head]:.3f} of {counts[name]}" for name in kinds if counts[name]))
    print(json.dumps({"model": args.model, "level": args.level, "pages": len(pages),
                      "heads": [[round(a, 3) for a in row] for row in share["all"].tolist()], "best": best}))


if __name__ == "__main__":
    main()
