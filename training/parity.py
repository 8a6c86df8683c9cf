"""Check this project's loader and model code against outputs of the original DeepSeek-OCR code.

usage: python -m ocr_latent.training.parity CHECKPOINT_DIR REFERENCE_FILE [--image page.png] [--tol 1e-4]

REFERENCE_FILE is a safetensors file with `{mode}.view/sam/clip/features/image_embeds/input_ids/
image_mask/logits_last4/greedy_ids`; its JSON sidecar (same name, .json) lists the modes, the prompt
ids and the number of greedy tokens. Runs in fp32 on the CPU; exits 0 only if every tensor is within
tolerance (views: 1 grey level) and the greedy tokens are identical.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from ocr_latent.checkpoint import load_model
from ocr_latent.generation import Generator
from ocr_latent.encoder import make_view, view_to_tensor


def compare_mode(model, ref: dict, mode: str, page: Image.Image, prompt_ids: list[int], n_greedy: int) -> list[tuple]:
    """Rows of (tensor, max abs error, limit) for one mode."""
    g = lambda k: ref[f"{mode}.{k}"]
    rows = []
    view = make_view(page, mode)
    view_err = np.abs(np.asarray(view, np.int16) - g("view").numpy().astype(np.int16)).max()
    rows.append(("view", float(view_err), 1.0))
    with torch.inference_mode():
        sam, clip, features = model.encoder.towers(view_to_tensor(view)[None])
        embeds = model.decoder.layout_image(features[0])
        for name, ours in (("sam", sam), ("clip", clip), ("features", features[0]), ("image_embeds", embeds)):
            theirs = g(name)
            err = (ours.float() - theirs).abs().max().item() if ours.shape == theirs.shape else float("inf")
            rows.append((name, err, None))
        # sequence layout: BOS, N image positions, prompt
        ids, mask = g("input_ids").tolist(), g("image_mask").bool().tolist()
        n = embeds.shape[0]
        layout_ok = (len(ids) == 1 + n + len(prompt_ids) and ids[0] == model.tokens.bos
                     and mask == [False] + [True] * n + [False] * len(prompt_ids) and ids[1 + n:] == prompt_ids)
        rows.append(("layout", 0.0 if layout_ok else float("inf"), 0.0))
        inputs = model.decoder.build_inputs(embeds, prompt_ids, model.tokens.bos)
        logits = model.decoder(inputs[None])[0, -4:]
        rows.append(("logits_last4", (logits - g("logits_last4")).abs().max().item(), None))
        # greedy continuation through the KV cache, no repetition rule, no EOS stop
        gen = Generator(model.decoder, slots=1, eos_id=-1, rule=None)
        seq = gen.generate([inputs], [n_greedy])[0]
        wrong = sum(a != b for a, b in zip(seq.tokens, g("greedy_ids").tolist())) + abs(len(seq.tokens) - n_greedy)
        rows.append(("greedy_ids (mismatches)", float(wrong), 0.0))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir")
    ap.add_argument("reference_file")
    ap.add_argument("--image", help="input page (default: page.png beside the reference)")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    ref_path = Path(args.reference_file)
    sidecar = json.loads(ref_path.with_suffix(".json").read_text())
    ref = load_file(str(ref_path))
    page = Image.open(args.image or ref_path.parent / "page.png")
    torch.manual_seed(0)
    model = load_model(args.checkpoint_dir, torch.float32, "cpu")
    ok = True
    print(f"{'mode':<6} {'tensor':<24} {'max abs err':>12} {'limit':>8}  result")
    for mode in sidecar["modes"]:
        for name, err, limit in compare_mode(model, ref, mode, page, sidecar["prompt_ids"], sidecar["greedy_tokens"]):
            limit = args.tol if limit is None else limit
            good = err <= limit
            ok &= good
            print(f"{mode:<6} {name:<24} {err:>12.3g} {limit:>8.3g}  {'ok' if good else 'FAIL'}")
    print("PARITY PASSED" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
