"""Uncompressed CER of a model (a training run's directory, or the embedded nano) on held-out pages of each
level of nano v3's curriculum (`pages.toward_ordinary`: 0 is 40-56 px text on ordinary pages, 8 (CURRICULUM_LEVELS)
the ordinary pages themselves, 18-40 px) and of nano v1's small pages (`small`): where a curriculum run stands.

    python bench/curriculum_levels.py runs/v3-joint --levels small,0,2,4,6,8 --pages 6
    python bench/curriculum_levels.py runs/v3-joint4 --levels 0 --pages 16 --seed 21 --split-at 48   # by glyph size
    python bench/curriculum_levels.py runs/v4-dec12 --levels 0 --pages 64 --seed 21 --by-line  # lines sharing a token row
    python bench/curriculum_levels.py runs/v4-dec12 --levels 0 --pages 16 --seed 21 --by-line --show 8  # and some of them
    python bench/curriculum_levels.py runs/v4r-dec2 --levels 0 --pages 64 --seed 21 --teacher-forced 16

With --by-line, the pages read as many lines as they have are also scored line by line: the CER of the
lines that share a row of vision tokens with another line (their middles in one 64 px row of the view, the
rows as towers trained with --field-targets see them: pages.FIELD_SHIFT) and of the lines that have a row to
themselves.

With --teacher-forced N, the first N pages of a level are also read teacher-forced (the right text before each
character, as in training): the share of their characters (spaces and line ends left out) the decoder predicts
right, on lines sharing a token row and on the rest. Set against the CER of the same kinds of line read freely, it
says how much of the free reading's error is errors compounding.
"""
from __future__ import annotations

import argparse
import json

import torch

from ocr_latent.checkpoint import load_model
from ocr_latent.training.evaluation import evaluate
from ocr_latent.training.losses import teacher_forced_logits
from ocr_latent.training.manifest import ROOT
from ocr_latent.training.nano import spells_by_character
from ocr_latent.training.pages import (LINE_KINDS, level_pages, line_of_boxes, lines_sharing_a_row, load_corpus,
                                       split_documents)
from ocr_latent.training.reading_metrics import edit_distance


@torch.no_grad()
def teacher_forced_by_line(model, pages) -> dict[str, dict]:
    """{line kind: {"chars": n, "right": share}}: the characters (not spaces or line ends) of `pages` the decoder
    predicts right given the right text before them, by whether their line shares a row of vision tokens. Pages
    the model's tokenizer cannot spell one token a character are left out ("pages_left_out")."""
    tally = {name: [0, 0] for name in LINE_KINDS}
    spelled = [p for p in pages if spells_by_character(model, p.text)]
    for i in range(0, len(spelled), 4):
        chunk = spelled[i:i + 4]
        feats = model.encoder.encode_images([p.image for p in chunk], "base")
        logits, target = teacher_forced_logits(model, [model.decoder.layout_image(f) for f in feats], [p.text for p in chunk])
        for row, page in enumerate(chunk):
            at = (target[row] != -100).nonzero().flatten()[:len(page.text)]  # the page's characters; EOS after them
            right = (logits[row, at].argmax(-1) == target[row, at]).tolist()
            shares = lines_sharing_a_row(page)
            glyphs = [k for k, ch in enumerate(page.text) if ch not in " \n"]  # line_of_boxes' characters, in order
            for k, line in zip(glyphs, line_of_boxes(page), strict=True):
                t = tally[LINE_KINDS[not shares[line]]]
                t[0], t[1] = t[0] + right[k], t[1] + 1
    return {"pages_left_out": len(pages) - len(spelled),
            **{name: {"chars": n, "right": round(r / n, 3) if n else None} for name, (r, n) in tally.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "weights" / "nano"), help="model directory")
    ap.add_argument("--levels", default="small,0,1,2,3,4", help="comma-separated levels; small: nano v1's pages")
    ap.add_argument("--pages", type=int, default=6, help="validation-split pages a level")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=9, help="page stream of the validation split (9: the pages train.py's "
                    "--advance-at gate reads)")
    ap.add_argument("--split-at", type=int, default=0, help="also the CER of pages under this font size (px) and of "
                    "the rest")
    ap.add_argument("--by-line", action="store_true", help="also the CER of lines that share a row of vision tokens "
                    "with another line and of the rest")
    ap.add_argument("--show", type=int, default=0, help="with --by-line: also print the first N lines of each kind a "
                    "level has, as written and as read")
    ap.add_argument("--teacher-forced", type=int, default=0, metavar="N", help="also the share of characters of the "
                    "first N pages read right teacher-forced, by kind of line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, docs, out = load_model(args.model), split_documents(load_corpus())["val"], {}
    for level in args.levels.split(","):
        pages = level_pages(docs, level, args.pages, args.seed)
        read = evaluate(model, pages, "base", max_tokens=args.max_tokens)
        out[level] = {"cer": round(read["cer"], 3), "chars": sum(len(p.text) for p in pages)}
        print(f"level {level:>5}: CER {read['cer']:.3f} over {args.pages} pages ({out[level]['chars']} characters)", flush=True)
        if args.split_at:
            for name, keep in ((f"under {args.split_at} px", lambda size: size < args.split_at),
                               (f"{args.split_at} px and over", lambda size: size >= args.split_at)):
                cers = [c for c, p in zip(read["cers"], pages) if keep(p.font_size)]
                out[level][name] = {"pages": len(cers), "cer": round(sum(cers) / len(cers), 3) if cers else None}
                print(f"    {name}: {out[level][name]}", flush=True)
        if args.by_line:
            tally = {name: [0, 0, 0] for name in LINE_KINDS}
            shown: dict[str, list[dict]] = {name: [] for name in tally}
            paired = 0
            for hyp, page in zip(read["hyps"], pages):
                said = hyp.split("\n")
                if len(said) != len(page.lines):
                    continue  # a line lost or split: no line-by-line pairing
                paired += 1
                for said_line, line, shares in zip(said, page.lines, lines_sharing_a_row(page)):
                    kind = LINE_KINDS[not shares]
                    t = tally[kind]
                    t[0], t[1], t[2] = t[0] + edit_distance(said_line, line), t[1] + len(line), t[2] + 1
                    if len(shown[kind]) < args.show:
                        shown[kind].append({"font_px": page.font_size, "written": line, "read": said_line})
            out[level]["by_line"] = {"pages_paired": paired, **{name: {"lines": n, "cer": round(e / c, 3) if c else None}
                                                                for name, (e, c, n) in tally.items()}}
            print(f"    line by line ({paired} pages read as many lines as they have): {out[level]['by_line']}", flush=True)
            for kind, lines in shown.items():
                for row in lines:
                    print(f"      {kind}, {row['font_px']} px:\n        written: {row['written']}\n        read:    {row['read']}")
            if args.show:
                out[level]["by_line"]["shown"] = shown
        if args.teacher_forced:
            out[level]["teacher_forced"] = teacher_forced_by_line(model, pages[:args.teacher_forced])
            print(f"    teacher-forced, characters right (first {args.teacher_forced} pages): "
                  f"{out[level]['teacher_forced']}", flush=True)
    print(json.dumps({"model": args.model, "pages_per_level": args.pages, "levels": out}))


if __name__ == "__main__":
    main()
