"""Training: the nano base model (from scratch, CPU) and FSQ quantizers (any base, frozen).

  python train.py base --out runs/nano --steps 3000            # resumes from runs/nano if present
  python train.py export --run runs/nano --to weights/nano     # original-layout checkpoint
  python train.py quantizer --base weights/nano --steps 600    # -> weights/nano/quantizer.safetensors

The nano model is DeepSeek-OCR's architecture at small widths (same code path: SAM -> CLIP ->
projector -> MoE decoder) with a character-level tokenizer, reading the rendered pages of pages.py.
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from checkpoint import OCRModel, SpecialTokens, build_modules, file_sha256, init_weights, load_model, save_model
from decoder import Generator, RepetitionRule
from encoder import MODES, make_view, views_to_tensor
from metrics import cer, wer
from pages import CHARSET, PageSpec, PageStream, char_targets, load_corpus, sources_manifest, split_documents

ROOT = Path(__file__).resolve().parent
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image>"]
FREE_PROMPT = "<image>\nFree OCR."


# ----------------------------------------------------------------------------- nano definition
def nano_config(vocab_size: int) -> dict:
    """A DeepSeek-OCR config.json (original layout) at nano sizes. Base mode: the 512 px page is
    letterboxed (here: scaled) to 1024 -> 16x16 tokens, each seeing 32x32 page pixels (about two
    characters of one line), the real model's 4096-code geometry (256 tokens x 16 dims). SAM uses
    windowed attention only: global attention over 64x64 patches is too slow to train on a CPU."""
    language = {
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_size": 256,
        "intermediate_size": 512, "kv_lora_rank": None, "lm_head": True, "max_position_embeddings": 8192,
        "moe_intermediate_size": 128, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "rm_head": False, "topk_group": 1,
        "topk_method": "greedy", "use_mla": False, "v_head_dim": 0, "vocab_size": vocab_size}
    return {
        "_name_or_path": "ocr-latent/nano", "architectures": ["DeepseekOCRForCausalLM"],
        "candidate_resolutions": [[1024, 1024]], "global_view_pos": "head", "model_type": "deepseek_vl_v2",
        "language_config": {**language, "architectures": ["DeepseekV2ForCausalLM"], "torch_dtype": "float32"},
        "projector_config": {"input_dim": 512, "model_type": "mlp_projector", "n_embed": 256, "projector_type": "linear"},
        "tile_tag": "2D", "torch_dtype": "float32",
        "vision_config": {"image_size": 1024, "model_name": "deeplip_b_l", "model_type": "vision", "width": {
            "clip-l-14-224": {"heads": 4, "image_size": 224, "layers": 2, "patch_size": 14, "width": 256},
            "sam_vit_b": {"downsample_channels": [128, 256], "global_attn_indexes": [], "heads": 2,
                          "layers": 2, "width": 64, "neck_channels": 32}}},
        "ocr_latent": {"mode": "base", "prompt": FREE_PROMPT}, **language}


def char_tokenizer():
    """Character-level tokenizer in tokenizers' format: specials, then '\\n' and printable ASCII."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["\n"] + list(CHARSET))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    return tok


def tokenizer_config(tok) -> dict:
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for s in SPECIALS}
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
            "pad_token": SPECIALS[2], "added_tokens_decoder": added, "tokenizer_class": "PreTrainedTokenizerFast"}


def new_nano(seed: int) -> OCRModel:
    tok = char_tokenizer()
    cfg = nano_config(tok.get_vocab_size())
    encoder, decoder = build_modules(cfg, "cpu")
    init_weights(encoder, decoder, seed=seed)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    tokens = SpecialTokens(bos=ids[SPECIALS[0]], eos=ids[SPECIALS[1]], pad=ids[SPECIALS[2]], image=ids["<image>"])
    return OCRModel(cfg, encoder, decoder, tokens, tok)


def save_run(model: OCRModel, out: Path, extra: dict[str, torch.Tensor] | None = None) -> None:
    save_model(model, out)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model.tokenizer), indent=1) + "\n")
    if extra:
        save_file({k: v.detach().contiguous() for k, v in extra.items()}, str(out / "train_state.safetensors"))


# ----------------------------------------------------------------------------- batches
def pixels_of(pages, mode: str) -> torch.Tensor:
    return views_to_tensor([make_view(p.image, mode) for p in pages])


def reading_prompt(model: OCRModel) -> str:
    """The prompt a model is trained and evaluated with: nano's own, else DeepSeek-OCR's free OCR."""
    return model.config.get("ocr_latent", {}).get("prompt", FREE_PROMPT)


def teacher_forced_loss(model: OCRModel, image_embeds: list[torch.Tensor], texts: list[str],
                        token_dropout: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the page text (and EOS) given BOS + image + prompt, as the decoder reads it.
    token_dropout replaces that share of the *input* text tokens by the pad token: a decoder that
    cannot lean on its own language model has to read the image (against posterior collapse)."""
    logits, target = teacher_forced_logits(model, image_embeds, texts, token_dropout)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def teacher_forced_logits(model: OCRModel, image_embeds: list[torch.Tensor], texts: list[str],
                          token_dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, T, V] of the decoder reading BOS + image + prompt + text, and the targets [B, T]
    (the next text token, -100 where nothing is scored)."""
    prompt = model.prompt_ids(reading_prompt(model))
    inputs, targets = [], []
    for emb, text in zip(image_embeds, texts):
        ids = model.tokenizer.encode(text, add_special_tokens=False).ids + [model.tokens.eos]
        given = ids[:-1]
        if token_dropout:
            keep = torch.rand(len(given)) >= token_dropout
            given = [t if k else model.tokens.pad for t, k in zip(given, keep.tolist())]
        x = model.decoder.build_inputs(emb, prompt + given, model.tokens.bos)
        inputs.append(x)
        # position p predicts token p+1; only the text positions are scored
        targets.append(torch.tensor([-100] * (x.shape[0] - len(ids)) + ids))
    T = max(x.shape[0] for x in inputs)
    embeds = torch.stack([F.pad(x, (0, 0, 0, T - x.shape[0])) for x in inputs])
    target = torch.stack([F.pad(t, (0, T - t.shape[0]), value=-100) for t in targets])
    return model.decoder(embeds), target


@torch.inference_mode()
def read_pages(model: OCRModel, embeds: list[torch.Tensor], max_tokens: int = 256, prefill=None) -> list[str]:
    """Greedy read-out of image embeddings [N, D] (already laid out) with the default prompt; `prefill`:
    a copy of the decoder at the prompts' precision, as a pipeline serves it."""
    prompt = model.prompt_ids(reading_prompt(model))
    gen = Generator(model.decoder, slots=len(embeds), eos_id=model.tokens.eos,
                    rule=RepetitionRule(exempt=frozenset(model.tokens.td)), prefill=prefill)
    inputs = [model.decoder.build_inputs(e, prompt, model.tokens.bos) for e in embeds]
    return [model.detokenize(s.tokens) for s in gen.generate(inputs, [max_tokens] * len(inputs))]


def evaluate(model: OCRModel, pages, mode: str, batch: int = 16, quantizer=None) -> dict:
    """CER/WER of greedy reading, uncompressed or through the quantizer's codes."""
    hyps = []
    for i in range(0, len(pages), batch):
        chunk = pages[i:i + batch]
        feats = model.encoder.encode_images([p.image for p in chunk], mode)
        with torch.inference_mode():
            if quantizer is not None:
                feats = quantizer.decode(quantizer.encode(feats))
        hyps += read_pages(model, [model.decoder.layout_image(f) for f in feats])
    cers = [cer(h, p.text) for h, p in zip(hyps, pages)]
    return {"cer": float(np.mean(cers)), "wer": float(np.mean([wer(h, p.text) for h, p in zip(hyps, pages)])),
            "pages": len(pages), "hyps": hyps, "cers": cers}


# ----------------------------------------------------------------------------- base training
def order_targets(page, grid: int, slots: int = 6) -> np.ndarray:
    """[grid*grid, slots] class ids: the characters whose centre lies in each cell, in reading
    order (the renderer lists boxes line by line, left to right); len(CHARSET) marks an empty slot.
    Unlike char_targets it tells each vision token what it shows *in order*."""
    index = {ch: k for k, ch in enumerate(CHARSET)}
    out = np.full((grid * grid, slots), len(CHARSET), dtype=np.int64)
    fill = np.zeros(grid * grid, dtype=np.int64)
    w, h = page.image.size
    for ch, x0, y0, x1, y1 in page.char_boxes:
        cell = min(grid - 1, int((y0 + y1) / 2 * grid / h)) * grid + min(grid - 1, int((x0 + x1) / 2 * grid / w))
        if ch in index and fill[cell] < slots:
            out[cell, fill[cell]] = index[ch]
            fill[cell] += 1
    return out



@torch.no_grad()
def calibrate_projector(model: OCRModel, pages, mode: str) -> float:
    """Centre the projector's output and scale it to unit norm per token, like the token embeddings.
    Untrained towers give image embeddings hundreds of times larger than token embeddings, with a
    large component common to all tokens; the decoder then sees near-identical image tokens, learns a
    language model instead of reading, and does not recover (seen in the first nano run)."""
    feats = model.encoder(pixels_of(pages, mode)).reshape(-1, model.decoder.cfg.hidden_size)
    mean = feats.mean(0)
    scale = (feats - mean).norm(dim=-1).mean()
    layer = model.encoder.projector.layers
    layer.weight.div_(scale)
    layer.bias.sub_(mean).div_(scale)
    return float(scale)


@torch.no_grad()
def fold_bottleneck(model: OCRModel, fsq) -> None:
    """Make the projector emit what the (linear) bottleneck passes: f -> P (f - b) + b, where P projects
    on the span of fsq.proj_out. The map is affine, so it folds into the projector's weights and the base
    keeps the original layout; fsq's codes of the folded features are those of the unfolded ones."""
    layer, w_out, b_out = model.encoder.projector.layers, fsq.proj_out.weight.float(), fsq.proj_out.bias.float()
    proj = w_out @ torch.linalg.pinv(w_out)
    layer.bias.copy_(proj @ (layer.bias.float() - b_out) + b_out)
    layer.weight.copy_(proj @ layer.weight.float())


def code_fsq(model: OCRModel, mode: str, levels: int, hidden: int = 0):
    """An FSQ with this base's code geometry: one token per 64x64 pixels of the mode's view, NUM_CODES codes."""
    from architecture import NUM_CODES
    from quantizer import FSQ
    tokens = (MODES[mode][0] // 64) ** 2
    return FSQ(model.decoder.cfg.hidden_size, tokens, [levels] * (NUM_CODES // tokens), hidden)


def prefixed(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The entries of one module (`name.` keys) in a flat training state, without the prefix."""
    return {k.removeprefix(name + "."): v for k, v in state.items() if k.startswith(name + ".")}


def saved_bottleneck(run: Path) -> dict[str, torch.Tensor]:
    """The FSQ state a --bottleneck run saved with its training state (empty for other runs)."""
    path = Path(run) / "train_state.safetensors"
    if not path.exists():
        return {}
    with safe_open(str(path), "pt") as f:
        return {k.removeprefix("bottleneck."): f.get_tensor(k) for k in f.keys() if k.startswith("bottleneck.")}


def through_bottleneck(fsq, feats: torch.Tensor, rounded_share: float) -> torch.Tensor:
    """Each sample's features through the bottleneck: rounded to the codes' levels (straight-through)
    with probability `rounded_share`, else only projected on the span of its codes (in fp32, for the rounding)."""
    with torch.autocast("cpu", enabled=False):
        feats = feats.float()
        rounded = torch.rand(len(feats), 1, 1) < rounded_share
        return torch.where(rounded, fsq(feats), fsq.features_of(fsq.proj_in(feats)))


def curriculum(step: int, every: int) -> PageSpec:
    """Few lines first, then the target task (3-6 lines) from step 3*every on."""
    top = min(6, 3 + step // every) if step >= every else 3
    low = 1 if step < every else min(3, 1 + step // every)
    return PageSpec(min_lines=low, max_lines=top)


def cache_stream_seed(seed: int) -> int:
    """PageStream seed of the feature cache of a run with --seed `seed` (kept apart from its batches)."""
    return seed + 7


def cosine_to_tenth(frac: float) -> float:
    """Learning-rate factor: cosine from 1 to 0.1 as `frac` goes from 0 to 1."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def build_feature_cache(model: OCRModel, docs, pages: int, seed: int, out: Path) -> tuple[torch.Tensor, list[str]]:
    """Frozen-encoder features of `pages` training pages, kept on disk (safetensors + JSON) so a
    resumed decoder stage does not re-encode them. The decoder stage then costs a decoder step only."""
    from pipeline import base_fingerprint
    path = out / "features.safetensors"
    # a cache is only good for the towers, pages and count it was made from
    key = {"base_fingerprint": base_fingerprint(model), "stream_seed": str(cache_stream_seed(seed)), "pages": str(pages)}
    if path.exists():
        with safe_open(str(path), "pt") as f:
            made_for = f.metadata() or {}
        if all(made_for.get(k) == v for k, v in key.items()):
            return load_file(str(path))["features"], json.loads((out / "features.json").read_text())
        print(f"{path} was made for other towers, pages or count ({made_for}); encoding again")
    stream = PageStream(docs["train"], PageSpec(), seed=cache_stream_seed(seed))
    feats, texts = [], []
    for i in tqdm(range(0, pages, 16), desc="feature cache", dynamic_ncols=True):
        chunk = [stream[j] for j in range(i, min(pages, i + 16))]
        feats.append(model.encoder.encode_images([p.image for p in chunk], model.config["ocr_latent"]["mode"]).to(torch.bfloat16))
        texts += [p.text for p in chunk]
    out.mkdir(parents=True, exist_ok=True)
    save_file({"features": torch.cat(feats)}, str(path), metadata=key)
    (out / "features.json").write_text(json.dumps(texts))
    return torch.cat(feats), texts


@torch.no_grad()
def slot_accuracy(model: OCRModel, order_head, pages, grid: int, slots: int, bottleneck=None) -> float:
    """Share of occupied reading-order slots the order head reads right (the encoder stage's metric),
    through the bottleneck's codes when there is one."""
    feats = model.encoder.encode_images([p.image for p in pages], model.config["ocr_latent"]["mode"])
    if bottleneck is not None:
        feats = bottleneck.decode(bottleneck.encode(feats))
    pred = order_head(feats).reshape(*feats.shape[:2], slots, -1).argmax(-1)
    target = torch.from_numpy(np.stack([order_targets(p, grid, slots) for p in pages]))
    occupied = target != len(CHARSET)
    return float((pred == target)[occupied].float().mean())


def train_base(args) -> None:
    """Stages: `joint` trains everything on text + auxiliary losses; `encoder` trains the towers and
    projector on the dense per-token losses alone (no decoder: a local recognition task that converges
    far faster); `decoder` freezes the towers and trains the decoder on cached features."""
    torch.manual_seed(args.seed)
    out = Path(args.out)
    docs = split_documents(load_corpus())
    if (out / "config.json").exists():
        model = load_model(out)
        state = load_file(str(out / "train_state.safetensors"))
        meta = json.loads((out / "train_meta.json").read_text())
        print(f"resuming {out} at step {meta['step']}")
    elif args.init:
        model, state, meta = load_model(args.init), {}, {"step": 0, "curve": [], "init": args.init}
    else:
        model, state, meta = new_nano(args.seed), {}, {"step": 0, "curve": []}
        calib = PageStream(docs["train"], PageSpec(), seed=args.seed + 1)
        scale = calibrate_projector(model, [calib[i] for i in range(32)], model.config["ocr_latent"]["mode"])
        meta["projector_calibration"] = f"output centred and divided by {scale:.2f}"
    stage = args.stage
    train_encoder, train_decoder = stage in ("joint", "encoder"), stage in ("joint", "decoder")
    model.encoder.train(train_encoder), model.decoder.train(train_decoder)
    D = model.decoder.cfg.hidden_size
    # the heads of the dense losses are dropped after training; behind a bottleneck they need a hidden
    # layer (a linear head on 16 dims can only give rank-16 logits for 6 slots x 100 classes)
    head = lambda n: (torch.nn.Sequential(torch.nn.Linear(D, args.head_hidden), torch.nn.GELU(), torch.nn.Linear(args.head_hidden, n))
                      if args.head_hidden else torch.nn.Linear(D, n))
    aux_head, order_head = head(len(CHARSET)), head(args.order_slots * (len(CHARSET) + 1))
    for name, module in (("aux", aux_head), ("order", order_head)):
        if own := prefixed(state, name):
            module.load_state_dict(own)
    use_order = bool(args.order_weight) and train_encoder
    bottleneck, bottleneck_needs_pca = None, False
    if args.bottleneck:  # a linear FSQ between the features and their readers (decoder, heads), learned with them
        if stage == "joint":
            raise SystemExit("--bottleneck trains with --stage encoder or decoder")
        bottleneck = code_fsq(model, model.config["ocr_latent"]["mode"], args.levels)
        # a resumed run's own FSQ, else the one an earlier --bottleneck stage (--init) carries over
        saved = prefixed(state, "bottleneck") or (saved_bottleneck(args.init) if args.init else {})
        if saved:
            bottleneck.load_state_dict(saved)
        bottleneck_needs_pca = not saved
    for p in [*model.encoder.parameters(), *model.decoder.parameters(), *(bottleneck.parameters() if bottleneck else [])]:
        p.requires_grad_(False)
    # the bottleneck learns with the decoder only: in the encoder stage the towers learn to fill the codes
    # the decoder reads (learning it there too, through its pseudo-inverse, diverged after 450 steps)
    params = [*(model.encoder.parameters() if train_encoder else []), *(model.decoder.parameters() if train_decoder else []),
              *(aux_head.parameters() if train_encoder else []), *(order_head.parameters() if use_order else []),
              *(bottleneck.parameters() if bottleneck and train_decoder else [])]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    for i, p in enumerate(params):  # parameters that never got a gradient (CLIP's unused patch conv) have none
        if f"opt.{i}.step" in state:
            opt.state[p] = {"step": state[f"opt.{i}.step"], "exp_avg": state[f"opt.{i}.exp_avg"],
                            "exp_avg_sq": state[f"opt.{i}.exp_avg_sq"]}
    mode, grid = model.config["ocr_latent"]["mode"], model.encoder.cfg.sam_image_size // 64
    val_pages = [p for p in PageStream(docs["val"], PageSpec(augment=False), seed=1, length=args.val_pages)]
    if stage == "decoder":
        cached, cached_texts = build_feature_cache(model, docs, args.cache_pages, args.seed, out)
        if bottleneck_needs_pca:
            bottleneck.init_from_pca(cached[:256].float())
            bottleneck_needs_pca = False
        epoch_order = functools.lru_cache(4)(lambda epoch: torch.randperm(
            len(cached_texts), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist())
    def page_batch(step: int):
        stream = PageStream(docs["train"], curriculum(step, args.curriculum) if stage == "joint" else PageSpec(), seed=args.seed)
        pages = [stream[step * args.batch + i] for i in range(args.batch)]
        return pages, pixels_of(pages, mode)

    # rendering and resizing (PIL, mostly outside the GIL) of the next batch overlap this step's compute
    loader = ThreadPoolExecutor(1)
    t0, step = time.time(), meta["step"]
    prefetch = {step: loader.submit(page_batch, step)} if stage != "decoder" else {}
    bar = tqdm(total=args.steps, initial=step, desc=f"base/{stage}", dynamic_ncols=True)
    while step < args.steps:
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if args.decay_from and step > args.decay_from:  # cosine to 10% over the remaining steps
            frac = (step - args.decay_from) / max(1, args.steps - args.decay_from)
            lr *= cosine_to_tenth(frac)
        for g in opt.param_groups:
            g["lr"] = lr
        row = {"step": step + 1}
        loss = torch.zeros(())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            if stage == "decoder":  # a fresh permutation of the cache each epoch
                n = len(cached_texts)
                idx = [epoch_order(g // n)[g % n] for g in range(step * args.batch, (step + 1) * args.batch)]
                feats, texts = cached[idx].float(), [cached_texts[i] for i in idx]
                if bottleneck:  # the decoder learns to read the projection, rounded to the codes' levels or not
                    feats = through_bottleneck(bottleneck, feats, args.bottleneck_rounded)
            else:
                pages, pixels = prefetch.pop(step).result()
                prefetch[step + 1] = loader.submit(page_batch, step + 1)
                feats, texts = model.encoder(pixels), [p.text for p in pages]
                if bottleneck:  # the heads read the projection, rounded to the codes' levels or not
                    if bottleneck_needs_pca:
                        bottleneck.init_from_pca(feats.detach().float())
                        bottleneck_needs_pca = False
                    feats = through_bottleneck(bottleneck, feats, args.bottleneck_rounded)
            if train_decoder:
                text = teacher_forced_loss(model, [model.decoder.layout_image(f) for f in feats], texts, args.token_dropout)
                loss, row["text_loss"] = loss + text, round(text.item(), 4)
            if train_encoder:
                aux_target = torch.from_numpy(np.stack([char_targets(p, grid) for p in pages]))
                aux = F.binary_cross_entropy_with_logits(aux_head(feats).float(), aux_target)
                loss, row["aux_loss"] = loss + args.aux_weight * aux, round(aux.item(), 4)
            if use_order:
                order_target = torch.from_numpy(np.stack([order_targets(p, grid, args.order_slots) for p in pages]))
                order_loss = F.cross_entropy(order_head(feats).float().reshape(-1, len(CHARSET) + 1), order_target.flatten())
                loss, row["order_loss"] = loss + args.order_weight * order_loss, round(order_loss.item(), 4)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: v for k, v in row.items() if k != "step"} | {"lr": f"{lr:.1e}"})
        if step % args.eval_every == 0 or step == args.steps:
            model.encoder.eval(), model.decoder.eval()
            if train_decoder:
                reader = model
                if bottleneck:  # what the export (bottleneck folded into the projector) reads, without and with the codes
                    reader = copy.deepcopy(model)
                    fold_bottleneck(reader, bottleneck)
                row["val_cer"] = round(evaluate(reader, val_pages, mode)["cer"], 4)
                if bottleneck:
                    row["val_cer_codes"] = round(evaluate(reader, val_pages, mode, quantizer=bottleneck)["cer"], 4)
            if use_order:
                row["val_slot_acc"] = round(slot_accuracy(model, order_head, val_pages, grid, args.order_slots, bottleneck), 4)
            model.encoder.train(train_encoder), model.decoder.train(train_decoder)
            tqdm.write(f"step {step}: {row}  ({time.time() - t0:.0f}s)")
        if step % 10 == 0 or "val_cer" in row or "val_slot_acc" in row:
            meta["curve"].append(row | {"stage": stage})
        if step % args.save_every == 0 or step == args.steps:
            meta.update(step=step, wall_s=meta.get("wall_s", 0) + time.time() - t0, seed=args.seed, args=vars(args))
            t0 = time.time()
            extra = {f"{name}.{k}": v for name, module in (("aux", aux_head), ("order", order_head))
                     for k, v in module.state_dict().items()}
            if bottleneck:
                extra.update({f"bottleneck.{k}": v for k, v in bottleneck.state_dict().items()})
            for i, p in enumerate(params):
                s = opt.state.get(p)
                if s:
                    extra.update({f"opt.{i}.step": s["step"], f"opt.{i}.exp_avg": s["exp_avg"], f"opt.{i}.exp_avg_sq": s["exp_avg_sq"]})
            tmp = out.with_name(out.name + ".tmp")
            save_run(model, tmp, extra)
            (tmp / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            for name in ("features.safetensors", "features.json"):  # the decoder stage's cache moves with the run
                if (out / name).exists():
                    (out / name).rename(tmp / name)
            if out.exists():
                out.with_name(out.name + ".old").exists() and subprocess.run(["rm", "-rf", str(out.with_name(out.name + ".old"))])
                out.rename(out.with_name(out.name + ".old"))
            tmp.rename(out)
    bar.close()
    loader.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- manifest
def code_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+uncommitted" if dirty else "") if rev else "unknown"
    except OSError:
        return "unknown"


MANIFEST_FORMAT = ("one record per shipped artifact under 'artifacts'; a record that replaced another moves the "
                   "older one to 'earlier', keyed by its weights_sha256, and later records name it by that hash "
                   "('initialized_from'); full training curves are files under training_curves/ ('curve_file')")


def update_manifest(artifact: str, record: dict, path: Path = ROOT / "training_manifest.json") -> str:
    """Record one trained artifact in the manifest (flat: see MANIFEST_FORMAT); returns the record's sha256."""
    manifest = json.loads(path.read_text()) if path.exists() else {}
    manifest = {"format": MANIFEST_FORMAT, "artifacts": manifest.get("artifacts", {}), "earlier": manifest.get("earlier", {})}
    # a record may name the commit its code was read at (a long run's start); else the code as it is now
    record = {"code_commit": code_commit(), **record, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    old = manifest["artifacts"].get(artifact)
    if old and old.get("weights_sha256") and old.get("weights_sha256") != record.get("weights_sha256"):
        manifest["earlier"][old["weights_sha256"]] = {"artifact": artifact, **old}
    manifest["artifacts"][artifact] = record
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def curve_file(manifest: Path, name: str, curve: list) -> str:
    """Write a full training curve beside the manifest; returns its path relative to the manifest's folder."""
    path = manifest.parent / "training_curves" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(curve, separators=(",", ":")) + "\n")
    return str(path.relative_to(manifest.parent))


def data_record(docs: dict, seed: int, spec: PageSpec, pages: dict) -> dict:
    return {"generator": "pages.py (rendered with Pillow, DejaVu fonts)", "seed": seed, "page_spec": vars(spec) | {"fonts": list(spec.fonts)},
            "split_by": "document", "pages": pages, "sources": sources_manifest(docs)}


def export_base(args) -> None:
    """Copy a training run's model (not its optimiser state) to a servable original-layout directory."""
    run, to = Path(args.run), Path(args.to)
    model = load_model(run)
    meta = json.loads((run / "train_meta.json").read_text())
    bottleneck = saved_bottleneck(run)
    if bottleneck:  # a --bottleneck run: the base emits the bottleneck's projection; its FSQ can start a quantizer
        fsq = code_fsq(model, model.config["ocr_latent"]["mode"], meta["args"]["levels"])
        fsq.load_state_dict(bottleneck)
        fold_bottleneck(model, fsq)
        fsq.save(run / "bottleneck.safetensors", {"from_run": str(run), "note": "linear FSQ learned with the decoder; "
                                                  "start a quantizer from it with train.py quantizer --init PATH"})
    save_run(model, to)
    docs = split_documents(load_corpus())
    val = evaluate(model, list(PageStream(docs["test"], PageSpec(augment=False), seed=2, length=args.test_pages)),
                   model.config["ocr_latent"]["mode"])
    # A staged run starts from another run (--init): record every stage back to the first, and the
    # manifest record of an exported model it started from, since runs/ is not kept.
    stages, init = [], run
    while (Path(init) / "train_meta.json").exists():
        m = json.loads((Path(init) / "train_meta.json").read_text())
        stages.insert(0, {"run": str(init), "stage": m.get("args", {}).get("stage", "joint"), "steps": m["step"],
                          "wall_s": round(m.get("wall_s", 0)), "hyperparameters": m.get("args", {}), "curve": m["curve"]})
        if not m.get("init"):
            break
        init = m["init"]
    manifest_path = Path(args.manifest)
    previous = json.loads(manifest_path.read_text())["artifacts"].get(f"{to.name}/base") if manifest_path.exists() else None
    record = {"kind": "base model trained from scratch", "dir": str(to.resolve().relative_to(ROOT)) if to.resolve().is_relative_to(ROOT) else str(to),
              "config": model.config, "steps": sum(s["steps"] for s in stages), "wall_s": sum(s["wall_s"] for s in stages),
              "stages": stages, "seed": meta.get("seed"),
              "data": data_record(docs, meta.get("seed", 0), PageSpec(), {"train": "stream, batch x steps",
                                                                                               "test": args.test_pages}),
              "test_metrics_uncompressed": {"cer": round(val["cer"], 4), "wer": round(val["wer"], 4), "pages": val["pages"]},
              "weights_sha256": file_sha256(to / "model-00001-of-000001.safetensors")}
    for i, stage in enumerate(stages):
        stage["curve_file"] = curve_file(manifest_path, f"{to.name}-base-{record['weights_sha256'][:12]}-stage{i + 1}",
                                         stage.pop("curve"))
    if previous and Path(init).resolve() == to.resolve() and not (Path(init) / "train_meta.json").exists():
        # the first stage started from an earlier export of this model (its record moves to "earlier")
        record["initialized_from"] = previous["weights_sha256"]
    update_manifest(f"{to.name}/base", record, manifest_path)
    print(f"exported step {meta['step']} to {to}: test CER {val['cer']:.4f} WER {val['wer']:.4f} on {val['pages']} pages")


def main(argv=None) -> None:
    import quantizer_training  # it builds on this module's losses and evaluation
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="train the nano base model from scratch (resumable)")
    b.add_argument("--out", default="runs/nano")
    b.add_argument("--steps", type=int, default=3000)
    b.add_argument("--stage", choices=["joint", "encoder", "decoder"], default="joint")
    b.add_argument("--init", help="start from this model directory (e.g. an earlier stage's run)")
    b.add_argument("--cache-pages", type=int, default=2048, help="decoder stage: training pages encoded once")
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--lr", type=float, default=1e-3)
    b.add_argument("--warmup", type=int, default=100)
    b.add_argument("--decay-from", type=int, default=0, help="cosine decay after this step (0: constant)")
    b.add_argument("--aux-weight", type=float, default=1.0)
    b.add_argument("--token-dropout", type=float, default=0.0, help="share of input text tokens replaced by pad")
    b.add_argument("--order-weight", type=float, default=0.0, help="weight of the reading-order aux loss")
    b.add_argument("--order-slots", type=int, default=6)
    b.add_argument("--curriculum", type=int, default=300, help="steps per curriculum stage")
    b.add_argument("--eval-every", type=int, default=200)
    b.add_argument("--val-pages", type=int, default=32)
    b.add_argument("--save-every", type=int, default=50)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--bottleneck", action="store_true", help="encoder/decoder stage: learn a linear FSQ whose codes the "
                   "heads/decoder read, carried from an --init run that has one; the export folds its projection into "
                   "the projector (a base whose features fit the codes)")
    b.add_argument("--bottleneck-rounded", type=float, default=0.5, help="share of samples read through the rounded codes")
    b.add_argument("--levels", type=int, default=16)
    b.add_argument("--head-hidden", type=int, default=0, help="encoder stage: hidden width of the dense-loss heads (0: linear)")
    b.add_argument("--bf16", action="store_true", help="bf16 autocast (CPUs with avx512_bf16/AMX)")
    b.add_argument("--threads", type=int, default=1)
    e = sub.add_parser("export", help="copy a training run's model to a servable directory")
    e.add_argument("--run", default="runs/nano")
    e.add_argument("--to", default="weights/nano")
    e.add_argument("--test-pages", type=int, default=64)
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--manifest", default=str(ROOT / "training_manifest.json"))
    q = sub.add_parser("quantizer", help="train the quantizer of a frozen base (resumable)")
    quantizer_training.add_arguments(q)
    q.add_argument("--manifest", default=str(ROOT / "training_manifest.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"base": train_base, "export": export_base, "quantizer": quantizer_training.train_quantizer}[args.cmd](args)


if __name__ == "__main__":
    main()
