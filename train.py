"""Training: the nano base model (from scratch, CPU) and FSQ quantizers (any base, frozen).

  python train.py base --out runs/nano --steps 3000            # resumes from runs/nano if present
  python train.py export --run runs/nano --to weights/nano     # original-layout checkpoint
  python train.py quantizer --base weights/nano --steps 600    # -> weights/nano/quantizer.safetensors
  python train.py quantizer --targets self --data scans/       # no transcripts: the base's own reading
  python train.py report --data held-out/                      # codes' reading vs the uncompressed one
  python train.py ship runs/joint-bank/nano                    # a banked base + quantizer become the default

The entry point. The nano model is defined in training/nano.py, the losses in training/losses.py, evaluation in
training/evaluation.py, feature caches in training/features.py, the manifest in training/manifest.py; the
quantizer's training in training/quantizer_trainer.py. This module holds the base's staged training and its export.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from ocr_latent.training import confidence, features, quantizer_trainer, self_reading
from ocr_latent.architecture import DTYPE_NAMES
from ocr_latent.checkpoint import OCRModel, file_sha256, load_model
from ocr_latent.training.evaluation import Renderers, evaluate, pixels_of, slot_accuracy
from ocr_latent.training.losses import (AttentionTap, Pointer, char_cells, lines_held, order_targets, pointer_accuracy,
                                       teacher_forced_logits, teacher_forced_loss)
from ocr_latent.training.manifest import ROOT, curve_file, data_record, update_manifest
from ocr_latent.training.nano import DEFAULT_FILES, grown_nano, model_charset, new_nano, save_run, split_inputs, widened_nano
from ocr_latent.training.recipe import code_fsq, cosine_to_tenth, training_device
from ocr_latent.training.pages import (CURRICULUM_LEVELS, FIELD_SHIFT, ORDINARY, PAGE_KINDS, PageSpec, PageStream, char_targets,
                                      level_pages, load_corpus, on_lines, split_documents, test_pages, toward_ordinary,
                                      training_documents)

# ----------------------------------------------------------------------------- base training
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


def take_decoder(model, donor, name: str) -> None:
    """Put `donor`'s language model (embeddings, layers, norm, head) in place of `model`'s: towers from one run,
    a decoder that reads better from another (it must have read features like these towers')."""
    if donor.decoder.cfg != model.decoder.cfg or model_charset(donor) != model_charset(model):
        raise SystemExit(f"--decoder-from {name}: its decoder or tokenizer differs from the run's; "
                         "both runs must descend from the same nano")
    model.decoder.load_state_dict(donor.decoder.state_dict())


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


def length_grouped_batch(lengths: list[int], batch: int, step: int, seed: int, groups: int) -> list[int]:
    """Step `step`'s batch when each epoch's permutation is cut into runs of `groups` batches, each run
    sorted by length and cut into batches, and the epoch's batches shuffled: every page once an epoch,
    batches of like lengths, in an order that is a function of (seed, epoch) alone (resumable)."""
    pages, per_epoch = len(lengths), len(lengths) // batch
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(pages, generator=gen).tolist()[:per_epoch * batch]
    run = groups * batch
    order = [i for s in range(0, len(order), run) for i in sorted(order[s:s + run], key=lambda i: lengths[i])]
    batches = [order[b * batch:(b + 1) * batch] for b in range(per_epoch)]
    return batches[torch.randperm(per_epoch, generator=gen)[k].item()]


def cache_stream_seed(seed: int) -> int:
    """PageStream seed of the feature cache of a run with --seed `seed` (kept apart from its batches)."""
    return seed + 7


class BaseTraining:
    """Stages: `joint` trains everything on text + auxiliary losses; `encoder` trains the towers and
    projector on the dense per-token losses alone (no decoder: a local recognition task that converges
    far faster); `decoder` freezes the towers and trains the decoder on cached features.
    A run directory (--out) holds the model, its heads, the optimiser and the curve; rerunning resumes."""

    def __init__(self, args):
        torch.manual_seed(args.seed)
        self.args, self.out, self.stage = args, Path(args.out), args.stage
        self.docs = split_documents(load_corpus())
        self.train_docs = training_documents(args.more_text)
        self.kind = PAGE_KINDS[args.pages]
        self.device = training_device(args.device)
        self.model, state, self.meta = self.load_or_start()
        model, stage = self.model, self.stage
        model.encoder.to(self.device), model.decoder.to(self.device)
        self.charset = model_charset(model)
        self.train_encoder, self.train_decoder = stage in ("joint", "encoder"), stage in ("joint", "decoder")
        model.encoder.train(self.train_encoder), model.decoder.train(self.train_decoder)
        D = model.decoder.cfg.hidden_size
        # the heads of the dense losses are dropped after training; behind a bottleneck they need a hidden
        # layer (a linear head on 16 dims can only give rank-16 logits for 6 slots x 100 classes)
        head = lambda n: (torch.nn.Sequential(torch.nn.Linear(D, args.head_hidden), torch.nn.GELU(), torch.nn.Linear(args.head_hidden, n))
                          if args.head_hidden else torch.nn.Linear(D, n))
        self.aux_head, self.order_head = head(len(self.charset)), head(args.order_slots * (len(self.charset) + 1))
        # a new run's heads may start from those another run trained (a decoder stage's run has untrained ones)
        heads_from = args.heads_from or args.widen_from
        saved_heads = Path(heads_from) / "train_state.safetensors" if heads_from and not state else None
        if saved_heads and not saved_heads.exists():
            if args.heads_from:
                raise SystemExit(f"--heads-from {args.heads_from}: it holds no train_state.safetensors (a training run's "
                                 f"directory does; an exported model has no heads)")
            saved_heads = None  # widened from an exported model (weights/nano): the heads start afresh
        heads = load_file(str(saved_heads)) if saved_heads else {}
        for name, module in (("aux", self.aux_head), ("order", self.order_head)):
            if own := prefixed(state, name) or prefixed(heads, name):
                module.load_state_dict(own)
        self.use_order = bool(args.order_weight) and self.train_encoder
        if not 1 <= args.slot_lines <= args.order_slots:
            raise SystemExit(f"--slot-lines {args.slot_lines}: give 1 to --order-slots ({args.order_slots}) groups")
        # patch-level reading: the characters of each 16 px patch in reading order, read off SAM's neck (64x64
        # at 1024): teaches the towers glyphs at the scale of ordinary text, under the tokens' coarser targets.
        # A softmax over classes, not a multi-hot presence: with ~190 classes and one or two characters a
        # patch, a per-class sigmoid's gradient is so diluted that it spends hundreds of steps learning the prior
        self.use_patch = bool(args.patch_weight) and self.train_encoder
        patch_outputs = args.patch_slots * (len(self.charset) + 1)
        self.patch_head = torch.nn.Linear(model.encoder.cfg.sam_neck_channels, patch_outputs) if self.use_patch else None
        if self.use_patch:
            own = prefixed(state, "patch") or prefixed(heads, "patch")
            if own and args.widen_from and "sam" in args.widen and not state:  # it reads the widened neck's copies
                own["weight"] = split_inputs(own["weight"], torch.Generator().manual_seed(args.seed))
            if own and own["weight"].shape == self.patch_head.weight.shape:
                self.patch_head.load_state_dict(own)
            model.encoder.sam_model.neck.register_forward_hook(lambda module, inputs, out: setattr(self, "neck", out))
        for module in (self.aux_head, self.order_head, self.patch_head):
            if module is not None:
                module.to(self.device)
        self.mode, self.grid = model.config["ocr_latent"]["mode"], model.encoder.cfg.sam_image_size // 64
        self.shift = FIELD_SHIFT if args.field_targets else 0.0  # which token a glyph is the target of
        self.token_view = on_lines if args.line_targets else (lambda page: page)  # by its line's middle, or its own
        # the guided heads by what they point at: every character's token, or only the second lines' (losses.char_cells)
        self.pointer_heads = {"every": pointer_heads(args.pointer_heads, model.decoder.cfg)} if args.pointer_weight else {}
        if args.pointer_weight and args.line_pointer_heads:
            self.pointer_heads["second_lines"] = pointer_heads(args.line_pointer_heads, model.decoder.cfg, "--line-pointer-heads")
        self.bottleneck, self.bottleneck_needs_pca = self.new_bottleneck(state)
        self.params = self.trainable()
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
        for i, p in enumerate(self.params):  # parameters that never got a gradient (CLIP's unused patch conv) have none
            # a head of another shape than the saved one (the earlier presence loss) starts afresh
            if f"opt.{i}.step" in state and state[f"opt.{i}.exp_avg"].shape == p.shape:
                self.opt.state[p] = {k: state[f"opt.{i}.{k}"].to(p.device) for k in ("step", "exp_avg", "exp_avg_sq")}
        val_kind = PageSpec(augment=False) if args.pages == "small" else self.kind  # the first runs' validation pages
        self.val_pages = list(PageStream(self.docs["val"], val_kind, seed=1, length=args.val_pages))
        if stage == "decoder":
            self.cached, self.cached_texts = features.load(model, args.cache_pages, cache_stream_seed(args.seed),
                                                           self.out / "features", kind=args.pages, more_text=args.more_text,
                                                           workers=args.workers)
            if self.pointer_heads:  # where each cached page's characters lie, as the towers were taught (the shift and view)
                placement = (f"grid {self.grid}, shift {self.shift}, on lines {args.line_targets}, charset {self.charset}, "
                             f"pointers {sorted(self.pointer_heads)}")
                self.cached_cells = features.cells(self.cached_texts, cache_stream_seed(args.seed), self.out / "features",
                                                   args.pages, args.more_text, self.page_cells, placement)
            if self.bottleneck_needs_pca:
                self.bottleneck.init_from_pca(self.cached[:256].to(self.device).float())
                self.bottleneck_needs_pca = False
        # the next batches are rendered while this step computes
        self.loader, self.prefetch = Renderers(args.workers, self.train_docs), {}
        self.gated = stage == "joint" and args.pages == "nano2" and bool(args.advance_at)
        self._level_pages = {}

    def load_or_start(self):
        args, out = self.args, self.out
        if (out / "config.json").exists():
            meta = json.loads((out / "train_meta.json").read_text())
            print(f"resuming {out} at step {meta['step']}")
            return load_model(out), load_file(str(out / "train_state.safetensors")), meta
        model, meta = self.new_model()
        if args.decoder_from:
            take_decoder(model, load_model(args.decoder_from), args.decoder_from)
            meta["decoder_from"] = args.decoder_from
        return model, {}, meta

    def new_model(self):
        args = self.args
        if args.init:
            return load_model(args.init), {"step": 0, "curve": [], "init": args.init}
        if args.grow_from:
            return grown_nano(load_model(args.grow_from), args.seed), {"step": 0, "curve": [], "grown_from": args.grow_from}
        if args.widen_from:
            towers = tuple(args.widen.split(","))
            return (widened_nano(load_model(args.widen_from), args.seed, towers),
                    {"step": 0, "curve": [], "widened_from": args.widen_from, "widened": list(towers)})
        model, meta = new_nano(args.seed, args.nano_version), {"step": 0, "curve": []}
        calib = PageStream(self.train_docs, self.kind, seed=args.seed + 1)
        scale = calibrate_projector(model, [calib[i] for i in range(32)], model.config["ocr_latent"]["mode"])
        meta["projector_calibration"] = f"output centred and divided by {scale:.2f}"
        return model, meta

    def new_bottleneck(self, state):
        """A linear FSQ between the features and their readers (decoder, heads), learned with them."""
        if not self.args.bottleneck:
            return None, False
        if self.stage == "joint":
            raise SystemExit("--bottleneck trains with --stage encoder or decoder")
        bottleneck = code_fsq(self.model, self.mode, self.args.levels)
        # a resumed run's own FSQ, else the one an earlier --bottleneck stage (--init) carries over
        saved = prefixed(state, "bottleneck") or (saved_bottleneck(self.args.init) if self.args.init else {})
        if saved:
            bottleneck.load_state_dict(saved)
        return bottleneck.to(self.device), not saved

    def trainable(self) -> list[torch.nn.Parameter]:
        model, bottleneck = self.model, self.bottleneck
        for p in [*model.encoder.parameters(), *model.decoder.parameters(), *(bottleneck.parameters() if bottleneck else [])]:
            p.requires_grad_(False)
        # the bottleneck learns with the decoder only: in the encoder stage the towers learn to fill the codes
        # the decoder reads (learning it there too, through its pseudo-inverse, diverged after 450 steps)
        params = [*(model.encoder.parameters() if self.train_encoder else []),
                  *(model.decoder.parameters() if self.train_decoder else []),
                  *(self.aux_head.parameters() if self.train_encoder else []),
                  *(self.order_head.parameters() if self.use_order else []),
                  *(bottleneck.parameters() if bottleneck and self.train_decoder else []),
                  *(self.patch_head.parameters() if self.use_patch else [])]  # last: saved optimiser states keep their indices
        for p in params:
            p.requires_grad_(True)
        return params

    def page_batch(self, step: int) -> Future:
        """Step `step`'s pages and pixels, as they are being rendered."""
        args = self.args
        if self.stage == "joint" and args.pages == "small":  # v1's first runs: few lines first
            kind = curriculum(step, args.curriculum)
        elif self.stage == "joint" and args.pages == "nano2":  # from large text (what v1 reads) to ordinary pages
            kind = toward_ordinary(self.level(step))
        else:
            kind = self.kind
        return self.loader.submit(kind, args.seed, list(range(step * args.batch, (step + 1) * args.batch)), self.mode)

    def level(self, step: int) -> int:
        """The curriculum level this step trains on: reached by reading the level below (--advance-at),
        or a level every --curriculum steps."""
        return self.meta.get("level", 0) if self.args.advance_at else step // self.args.curriculum

    def level_pages(self, level) -> list:
        """Validation pages of a curriculum level or of v1's small pages (pages.level_pages), made once."""
        if level not in self._level_pages:
            self._level_pages[level] = level_pages(self.docs["val"], level, self.args.level_val_pages)
        return self._level_pages[level]

    def cached_batch(self, step: int):
        """A fresh permutation of the cache each epoch; with --length-groups G, pages of like length
        share a batch (a padded batch costs as much as its longest page times its size). Returns the
        features, texts and (with --pointer-weight) the pages' char_cells."""
        args = self.args
        if args.length_groups > 1:
            idx = length_grouped_batch([len(t) for t in self.cached_texts], args.batch, step, args.seed, args.length_groups)
        else:
            idx = features.epoch_batch(len(self.cached_texts), args.batch, step, args.seed)
        cells = [self.cached_cells[i] for i in idx] if self.pointer_heads else None
        return self.cached[idx].to(self.device).float(), [self.cached_texts[i] for i in idx], cells

    def page_cells(self, page) -> dict[str, list[int]]:
        """char_cells of a page for each kind of guided head, the characters placed as the towers' dense losses
        place them (--field-targets, --line-targets)."""
        view = self.token_view(page)
        return {kind: char_cells(view, self.grid, self.shift, self.charset, second_lines=kind == "second_lines")
                for kind in self.pointer_heads}

    def pointers(self, cells) -> list[Pointer]:
        """The pointer losses' targets of a batch (`cells`: page_cells of its pages)."""
        return [Pointer(heads, [c[kind] for c in cells], self.grid) for kind, heads in self.pointer_heads.items()]

    def learning_rate(self, step: int) -> float:
        args = self.args
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if args.decay_from and step > args.decay_from:  # cosine to 10% over the remaining steps
            lr *= cosine_to_tenth((step - args.decay_from) / max(1, args.steps - args.decay_from))
        return lr

    def step(self, step: int) -> dict:
        """One optimiser step; returns the logged losses."""
        args, model, bottleneck = self.args, self.model, self.bottleneck
        row, loss, device = {"step": step + 1}, torch.zeros((), device=self.device), self.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            if self.stage == "decoder":
                feats, texts, cells = self.cached_batch(step)
                if bottleneck:  # the decoder learns to read the projection, rounded to the codes' levels or not
                    feats = through_bottleneck(bottleneck, feats, args.bottleneck_rounded)
            else:
                pages, pixels = (self.prefetch.pop(step, None) or self.page_batch(step)).result()
                for ahead in range(step + 1, min(step + 1 + self.loader.ahead, args.steps)):
                    if ahead not in self.prefetch:
                        self.prefetch[ahead] = self.page_batch(ahead)
                feats, texts = model.encoder(pixels.to(device, non_blocking=True)), [p.text for p in pages]
                cells = [self.page_cells(p) for p in pages] if self.pointer_heads else None
                if bottleneck:  # the heads read the projection, rounded to the codes' levels or not
                    if self.bottleneck_needs_pca:
                        bottleneck.init_from_pca(feats.detach().float())
                        self.bottleneck_needs_pca = False
                    feats = through_bottleneck(bottleneck, feats, args.bottleneck_rounded)
            if self.train_decoder:
                text, pointer = teacher_forced_loss(model, [model.decoder.layout_image(f) for f in feats], texts,
                                                    args.token_dropout, self.pointers(cells) if cells else [])
                loss, row["text_loss"] = loss + text, round(text.item(), 4)
                if pointer is not None:
                    loss, row["pointer_loss"] = loss + args.pointer_weight * pointer, round(pointer.item(), 4)
            if self.train_encoder:
                token_pages = [self.token_view(p) for p in pages]
                aux_target = torch.from_numpy(np.stack([char_targets(p, self.grid, self.charset, self.shift) for p in token_pages])).to(device)
                aux = F.binary_cross_entropy_with_logits(self.aux_head(feats).float(), aux_target)
                loss, row["aux_loss"] = loss + args.aux_weight * aux, round(aux.item(), 4)
            if self.use_order:
                order_target = torch.from_numpy(np.stack([order_targets(p, self.grid, args.order_slots, self.charset, self.shift,
                                                                        args.slot_lines) for p in token_pages])).to(device)
                order_loss = F.cross_entropy(self.order_head(feats).float().reshape(-1, len(self.charset) + 1),
                                             order_target.flatten(), reduction="none").reshape(order_target.shape)
                weight = torch.ones(order_target.shape[:2], device=device)
                if args.two_line_weight != 1:  # tokens holding two or more text lines weigh more
                    held = np.stack([lines_held(p, self.grid, self.charset, self.shift) for p in token_pages])
                    weight = torch.from_numpy(np.where(held >= 2, args.two_line_weight, 1.0)).float().to(device)
                weight = weight[..., None].expand_as(order_loss)
                order_loss = (order_loss * weight).sum() / weight.sum()
                loss, row["order_loss"] = loss + args.order_weight * order_loss, round(order_loss.item(), 4)
            if self.use_patch:
                neck = self.neck.flatten(2).transpose(1, 2)  # this step's [B, patches, C]
                patch_target = torch.from_numpy(np.stack([order_targets(p, 4 * self.grid, args.patch_slots, self.charset)
                                                          for p in pages])).to(device)
                patch = F.cross_entropy(self.patch_head(neck).float().reshape(-1, len(self.charset) + 1),
                                        patch_target.flatten())
                loss, row["patch_loss"] = loss + args.patch_weight * patch, round(patch.item(), 4)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return row

    def evaluate(self, step: int = 0) -> dict:
        """Validation CER (what the export reads: the bottleneck folded in, uncompressed and through its
        codes) and the order head's slot accuracy."""
        args, model, bottleneck, row = self.args, self.model, self.bottleneck, {}
        model.encoder.eval(), model.decoder.eval()
        level = self.meta.get("level", 0)  # the level trained on so far (a gated curriculum's)
        if self.gated:  # the level it trains on, and the small pages it should keep reading
            row["level"] = level
            row["val_level_cer"] = round(evaluate(model, self.level_pages(level), self.mode, max_tokens=args.max_tokens)["cer"], 4)
            row["val_small_cer"] = round(evaluate(model, self.level_pages("small"), self.mode, max_tokens=args.max_tokens)["cer"], 4)
            if row["val_level_cer"] < args.advance_at and level < CURRICULUM_LEVELS:
                self.meta["level"] = level + 1
                self.meta.setdefault("levels_reached", []).append({"level": level + 1, "step": step})
        if self.train_decoder and (not self.gated or level >= CURRICULUM_LEVELS):
            reader = model
            if bottleneck:
                reader = copy.deepcopy(model)
                fold_bottleneck(reader, bottleneck)
            row["val_cer"] = round(evaluate(reader, self.val_pages, self.mode, max_tokens=args.max_tokens)["cer"], 4)
            if bottleneck:
                row["val_cer_codes"] = round(evaluate(reader, self.val_pages, self.mode, quantizer=bottleneck,
                                                      max_tokens=args.max_tokens)["cer"], 4)
        # on a gated curriculum the towers are measured on the level's pages: those they are learning
        pages = self.level_pages(level) if self.gated else self.val_pages
        if self.use_order or self.use_patch:  # the validation pages through the towers once, for both heads
            with torch.no_grad():
                feats = model.encoder.encode_images([p.image for p in pages], self.mode)  # and self.neck
        if self.pointer_heads:
            for kind, accuracy in self.guided_head_accuracy(self.val_pages).items():
                row["val_pointer_acc" if kind == "every" else "val_line_pointer_acc"] = round(accuracy, 4)
        if self.use_order:
            row["val_slot_acc"] = round(slot_accuracy(feats, self.order_head, [self.token_view(p) for p in pages], self.grid,
                                                      args.order_slots, self.charset, bottleneck, self.shift,
                                                      args.slot_lines), 4)
        if self.use_patch:
            row["val_patch_acc"] = round(self.patch_accuracy(self.neck, pages), 4)
        model.encoder.train(self.train_encoder), model.decoder.train(self.train_decoder)
        return row

    @torch.no_grad()
    def guided_head_accuracy(self, pages: list) -> dict[str, float]:
        """For each kind of guided head, the share of the validation pages' characters at whose target (token, or
        BOS) the heads look most, teacher-forced."""
        model, hits = self.model, {kind: [] for kind in self.pointer_heads}
        for i in range(0, len(pages), 4):
            chunk = pages[i:i + 4]
            feats = model.encoder.encode_images([p.image for p in chunk], self.mode)
            if self.bottleneck:
                feats = self.bottleneck(feats)
            pointers = self.pointers([self.page_cells(p) for p in chunk])
            with AttentionTap(model.decoder, {layer for p in pointers for layer, _ in p.heads}) as tap:
                _, target = teacher_forced_logits(model, [model.decoder.layout_image(f) for f in feats], [p.text for p in chunk])
            for kind, pointer in zip(hits, pointers):
                hits[kind].append(pointer_accuracy(tap, pointer, target))
        return {kind: sum(h) / max(1, len(h)) for kind, h in hits.items()}

    @torch.no_grad()
    def patch_accuracy(self, neck: torch.Tensor, pages: list) -> float:
        """Share of the pages' occupied patch slots the patch head reads right from SAM's neck (of those pages)."""
        pred = self.patch_head(neck.flatten(2).transpose(1, 2))
        pred = pred.reshape(len(pages), -1, self.args.patch_slots, len(self.charset) + 1).argmax(-1)
        target = torch.from_numpy(np.stack([order_targets(p, 4 * self.grid, self.args.patch_slots, self.charset)
                                            for p in pages])).to(pred.device)
        occupied = target != len(self.charset)
        right, total = int((pred == target)[occupied].sum()), int(occupied.sum())
        return right / max(1, total)

    def save(self) -> None:
        """Model, heads, bottleneck and optimiser into a fresh directory, then swapped in for the old one."""
        out = self.out
        heads = (("aux", self.aux_head), ("order", self.order_head), ("patch", self.patch_head))
        extra = {f"{name}.{k}": v for name, module in heads if module is not None for k, v in module.state_dict().items()}
        if self.bottleneck:
            extra.update({f"bottleneck.{k}": v for k, v in self.bottleneck.state_dict().items()})
        for i, p in enumerate(self.params):
            for k, v in self.opt.state.get(p, {}).items():
                extra[f"opt.{i}.{k}"] = v
        tmp = out.with_name(out.name + ".tmp")
        save_run(self.model, tmp, extra)
        (tmp / "train_meta.json").write_text(json.dumps(self.meta, indent=1) + "\n")
        for kept in ("features", "best"):  # the decoder stage's cache and the best reader move with the run
            if (out / kept).exists():
                (out / kept).rename(tmp / kept)
        if out.exists():
            old = out.with_name(out.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
        tmp.rename(out)

    def keep_if_best(self, step: int, row: dict) -> None:
        """With --keep-best: the model that read the validation pages best so far (through the codes where a
        bottleneck is learned), servable and exportable as OUT/best, since a decoder stage on a fixed cache
        reads best before it has overfitted it."""
        score = row.get("val_cer_codes", row.get("val_cer"))
        if not self.args.keep_best or score is None or score >= self.meta.get("best", {}).get("val_cer", float("inf")):
            return
        self.meta["best"] = {"step": step, "val_cer": score}
        extra = {f"bottleneck.{k}": v for k, v in self.bottleneck.state_dict().items()} if self.bottleneck else {}
        best, tmp = self.out / "best", self.out / "best.tmp"
        save_run(self.model, tmp, extra)
        (tmp / "train_meta.json").write_text(json.dumps(self.meta | {"step": step, "args": vars(self.args)}, indent=1) + "\n")
        if best.exists():
            shutil.rmtree(best)
        tmp.rename(best)

    def run(self) -> None:
        args, meta = self.args, self.meta
        t0, step = time.time(), meta["step"]
        stop_at = time.monotonic() + args.stop_after_s if args.stop_after_s else float("inf")
        bar = tqdm(total=args.steps, initial=step, desc=f"base/{self.stage}", dynamic_ncols=True)
        while step < args.steps:
            lr = self.learning_rate(step)
            for g in self.opt.param_groups:
                g["lr"] = lr
            row = self.step(step)
            step += 1
            bar.update(1)
            bar.set_postfix({k: v for k, v in row.items() if k != "step"} | {"lr": f"{lr:.1e}"})
            last = step == args.steps or time.monotonic() >= stop_at  # the run's last step, or this call's
            if step % args.eval_every == 0 or last:
                row |= self.evaluate(step)
                self.keep_if_best(step, row)
                tqdm.write(f"step {step}: {row}  ({time.time() - t0:.0f}s)")
            if step % 10 == 0 or any(k.startswith("val_") for k in row):
                meta["curve"].append(row | {"stage": self.stage})
            if step % args.save_every == 0 or last:
                meta.update(step=step, wall_s=meta.get("wall_s", 0) + time.time() - t0, seed=args.seed, args=vars(args))
                t0 = time.time()
                self.save()
            if last and step < args.steps:
                tqdm.write(f"stopped at step {step} of {args.steps} after --stop-after-s {args.stop_after_s:g}; the same "
                           f"command resumes the run")
                break
        bar.close()
        self.loader.shutdown()


def pointer_heads(spec: str, cfg, option: str = "--pointer-heads") -> list[tuple[int, int]]:
    """--pointer-heads "L:H,...": (layer, head) pairs; empty: head 0 of every layer but the first, whose queries know
    only their own character (a pointer needs the lower layers' reading of where the last character was)."""
    if not spec:
        return [(layer, 0) for layer in range(1, cfg.num_hidden_layers)]
    try:
        heads = [tuple(int(n) for n in item.split(":")) for item in spec.split(",")]
    except ValueError:
        heads = [()]
    if any(len(h) != 2 or not (0 <= h[0] < cfg.num_hidden_layers and 0 <= h[1] < cfg.num_attention_heads) for h in heads):
        raise SystemExit(f"{option} {spec}: give layer:head pairs, layers 0-{cfg.num_hidden_layers - 1}, "
                         f"heads 0-{cfg.num_attention_heads - 1}, e.g. 1:0,2:0")
    return heads


def train_base(args) -> None:
    BaseTraining(args).run()


# ----------------------------------------------------------------------------- export
def run_history(run: Path) -> tuple[list[dict], list[str]]:
    """Every training stage a run was made of, each once, a stage after those it started from: the run its model
    came from (--init, or --widen-from/--grow-from, whose towers were resized from it) and the run its decoder came
    from (--decoder-from). Also the exported models the first stages started from, whose manifest records stay the
    only trace of them, since runs/ is not kept."""
    stages, starts, seen = [], [], set()

    def visit(path: str) -> None:
        if str(Path(path).resolve()) in seen:
            return
        seen.add(str(Path(path).resolve()))
        if not (Path(path) / "train_meta.json").exists():
            starts.append(path)
            return
        m = json.loads((Path(path) / "train_meta.json").read_text())
        for parent in (m.get("init") or m.get("widened_from") or m.get("grown_from"), m.get("decoder_from")):
            if parent:
                visit(parent)
        stages.append({"run": str(path), "stage": m.get("args", {}).get("stage", "joint"), "steps": m["step"],
                       "wall_s": round(m.get("wall_s", 0)), "hyperparameters": m.get("args", {}), "curve": m["curve"]})

    visit(str(run))
    return stages, starts


def recorded_path(path: Path) -> str:
    """A path as the manifest records it: relative to the repository when inside it (weights/nano), else as given."""
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


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
    dtype = DTYPE_NAMES[args.dtype]
    if dtype != "float32":  # the file says what it holds, as DeepSeek-OCR's own bf16 checkpoint does
        model.config = {**model.config, "torch_dtype": dtype}
    save_run(model, to, dtype=getattr(torch, dtype))
    model = load_model(to)  # as the service will load it: the test reads what ships, rounded to --dtype
    docs = split_documents(load_corpus())
    kind = meta.get("args", {}).get("pages", "small")
    # a model of ordinary pages is tested on ordinary pages as photographed (the small-page set stays as it was)
    test_spec, max_tokens = (None, 256) if kind == "small" else (ORDINARY, 2048)
    val = evaluate(model, list(test_pages(args.test_pages, seed=2, spec=test_spec)),
                   model.config["ocr_latent"]["mode"], max_tokens=max_tokens)
    stages, starts = run_history(run)
    manifest_path = Path(args.manifest)
    previous = json.loads(manifest_path.read_text())["artifacts"].get(f"{to.name}/base") if manifest_path.exists() else None
    record = {"kind": "base model trained from scratch", "dir": recorded_path(to),
              "config": model.config, "steps": sum(s["steps"] for s in stages), "wall_s": sum(s["wall_s"] for s in stages),
              "stages": stages, "seed": meta.get("seed"),
              "data": data_record(docs, meta.get("seed", 0), PAGE_KINDS[kind], {"train": "stream, batch x steps",
                                                                                 "test": args.test_pages},
                                  more_text=any(s["hyperparameters"].get("more_text") for s in stages)),
              "test_metrics_uncompressed": {"cer": round(val["cer"], 4), "wer": round(val["wer"], 4), "pages": val["pages"]},
              "weights_sha256": file_sha256(to / "model-00001-of-000001.safetensors")}
    for i, stage in enumerate(stages):
        stage["curve_file"] = curve_file(manifest_path, f"{to.name}-base-{record['weights_sha256'][:12]}-stage{i + 1}",
                                         stage.pop("curve"))
    if previous and any(Path(start).resolve() == to.resolve() for start in starts):
        # the first stage started from an earlier export of this model (its record moves to "earlier")
        record["initialized_from"] = previous["weights_sha256"]
    update_manifest(f"{to.name}/base", record, manifest_path)
    print(f"exported step {meta['step']} to {to}: test CER {val['cer']:.4f} WER {val['wer']:.4f} on {val['pages']} pages")


def ship(args) -> None:
    """Make a banked default (a base exported to a directory named nano, and its quantizer) the embedded one: its
    files replace weights/nano, its two records replace the manifest's (theirs move to 'earlier'), with their curves.
    Only what the records describe ships: the files' hashes must match, and the code must have been committed."""
    src, to, manifest = Path(args.source), Path(args.to), Path(args.manifest)
    bank = Path(args.bank_manifest) if args.bank_manifest else src.parent / "manifest.json"
    missing = [name for name in DEFAULT_FILES if not (src / name).exists()]
    if missing or not bank.exists():
        raise SystemExit(f"{src}: not a banked default ({', '.join(missing) or bank.name} missing); "
                         f"make one with training/nano4.sh's bank step")
    records = json.loads(bank.read_text())["artifacts"]
    base, quantizer = records.get(f"{src.name}/base"), records.get(f"{src.name}/quantizer")
    problems = []
    if not base or base["weights_sha256"] != file_sha256(src / "model-00001-of-000001.safetensors"):
        problems.append(f"{bank} has no record of the base in {src} as it is")
    if not quantizer or quantizer["weights_sha256"] != file_sha256(src / "quantizer.safetensors"):
        problems.append(f"{bank} has no record of the quantizer in {src} as it is")
    problems += [f"its {what} was made by uncommitted code ({rec['code_commit']}); train it again from a commit"
                 for what, rec in (("base", base), ("quantizer", quantizer))
                 if rec and rec.get("code_commit", "").endswith("+uncommitted")]
    if problems:
        raise SystemExit("nothing shipped: " + "; ".join(problems))
    to.mkdir(parents=True, exist_ok=True)
    for name in DEFAULT_FILES:  # each file whole: a copy beside it, then renamed over the old
        shutil.copyfile(src / name, to / f".{name}.tmp")
        (to / f".{name}.tmp").rename(to / name)
    for path in to.iterdir():  # nothing of the previous default stays (another shard count, say)
        if path.name not in DEFAULT_FILES:
            path.unlink()
    curves = [stage["curve_file"] for stage in base.get("stages", []) if "curve_file" in stage] + \
             ([quantizer["curve_file"]] if "curve_file" in quantizer else [])
    for curve in curves:  # named by their content (manifest.curve_file): one already there is kept, as it was written
        if not (manifest.parent / curve).exists():
            (manifest.parent / curve).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bank.parent / curve, manifest.parent / curve)
    for kind, record in (("base", base), ("quantizer", quantizer)):
        update_manifest(f"nano/{kind}", {**record, "shipped_as": recorded_path(to)}, manifest)
    print(f"shipped {src} as {to}: base {base['weights_sha256'][:12]}, quantizer {quantizer['weights_sha256'][:12]}")


def main(argv=None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="train the nano base model from scratch (resumable)")
    b.add_argument("--out", default="runs/nano")
    b.add_argument("--steps", type=int, default=3000)
    b.add_argument("--stage", choices=["joint", "encoder", "decoder"], default="joint")
    b.add_argument("--init", help="start from this model directory (e.g. an earlier stage's run)")
    b.add_argument("--cache-pages", type=int, default=2048, help="decoder stage: training pages encoded once")
    b.add_argument("--length-groups", type=int, default=1, help="decoder stage: batch pages of like text length "
                   "within runs of this many batches (1: no grouping)")
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--lr", type=float, default=1e-3)
    b.add_argument("--warmup", type=int, default=100)
    b.add_argument("--decay-from", type=int, default=0, help="cosine decay after this step (0: constant)")
    b.add_argument("--aux-weight", type=float, default=1.0)
    b.add_argument("--token-dropout", type=float, default=0.0, help="share of input text tokens replaced by pad")
    b.add_argument("--order-weight", type=float, default=0.0, help="weight of the reading-order aux loss")
    b.add_argument("--order-slots", type=int, default=6)
    b.add_argument("--patch-weight", type=float, default=0.0, help="encoder stage: weight of the per-patch (16 px) "
                   "reading-order loss on SAM's neck")
    b.add_argument("--patch-slots", type=int, default=2, help="characters read per 16 px patch")
    b.add_argument("--curriculum", type=int, default=300, help="joint stage: steps per curriculum level (small pages: "
                   "more lines a level; nano2: smaller text a level, pages.toward_ordinary)")
    b.add_argument("--advance-at", type=float, default=0.0, help="joint stage, nano2: go up a curriculum level when "
                   "the level's validation pages read under this CER (0: a level every --curriculum steps)")
    b.add_argument("--level-val-pages", type=int, default=6, help="with --advance-at: validation pages of the level")
    b.add_argument("--eval-every", type=int, default=200)
    b.add_argument("--val-pages", type=int, default=32)
    b.add_argument("--save-every", type=int, default=50)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--bottleneck", action="store_true", help="encoder/decoder stage: learn a linear FSQ whose codes the "
                   "heads/decoder read, carried from an --init run that has one; the export folds its projection into "
                   "the projector (a base whose features fit the codes)")
    b.add_argument("--bottleneck-rounded", type=float, default=0.5, help="share of samples read through the rounded codes")
    b.add_argument("--levels", type=int, default=16)
    b.add_argument("--heads-from", help="a new run: start the dense-loss heads from this run's (same --head-hidden, "
                   "--order-slots and tokenizer)")
    b.add_argument("--field-targets", action="store_true", help="encoder stage and the pointer loss: a glyph is the "
                   "dense-loss target of the token that sees it whole (pages.FIELD_SHIFT), not of the one whose square holds its centre")
    b.add_argument("--line-targets", action="store_true", help="encoder stage and the pointer loss: a glyph is a "
                   "token's target by its line's middle, not its own ink's (pages.on_lines): a line's glyphs share a token row")
    b.add_argument("--slot-lines", type=int, default=1, help="encoder stage: the order head's slots in this many "
                   "groups, one for each text line a token holds (losses.slot_positions); 1: one run in reading order")
    b.add_argument("--two-line-weight", type=float, default=1.0, help="encoder stage: weight of the order loss of "
                   "tokens holding two or more text lines (losses.lines_held) against one for the others")
    b.add_argument("--pointer-weight", type=float, default=0.0, help="joint/decoder stage: weight of the pointer loss "
                   "(losses.pointer_loss): guided heads attend, at each text position, to the vision token showing the "
                   "character it predicts, placed as --field-targets/--line-targets say")
    b.add_argument("--pointer-heads", default="", help="with --pointer-weight: layer:head pairs guided (default: head 0 "
                   "of every layer but the first)")
    b.add_argument("--line-pointer-heads", default="", help="with --pointer-weight: layer:head pairs guided to the token "
                   "of a character only where its text line is not the first in that token (the lower of two lines "
                   "sharing it), and to BOS elsewhere: heads that say which of a token's lines is being read")
    b.add_argument("--head-hidden", type=int, default=0, help="encoder stage: hidden width of the dense-loss heads (0: linear)")
    b.add_argument("--pages", choices=sorted(PAGE_KINDS), default="small", help="page kind trained and validated on "
                   "(pages.py: small = nano v1's 512 px pages; nano2 = ordinary pages with some small ones; levelK = the "
                   "curriculum's level K; level0-close = level 0 with its lines closer)")
    b.add_argument("--nano-version", type=int, choices=[1, 2], default=1, help="sizes of a model started from scratch (nano.py)")
    b.add_argument("--grow-from", help="start from nano v3 grown from this trained v1 model directory (nano.grown_nano)")
    b.add_argument("--widen-from", help="start from this trained run with wider towers (--widen), reading as it did "
                   "(nano.widened_nano; nano v4 is v3 with SAM widened); its dense-loss heads come along")
    b.add_argument("--widen", default="sam", choices=["sam", "clip", "sam,clip"], help="with --widen-from: the towers "
                   "made twice as wide (clip: also SAM's last conv and the projector's input)")
    b.add_argument("--decoder-from", help="a new run: its decoder (language model) from this run, the towers from "
                   "--init/--widen-from (the same nano's decoder, trained further on features like these)")
    b.add_argument("--more-text", action="store_true", help="training pages draw their text from the train-only "
                   "documents too (corpus/train-only: the standard library's docstrings); held-out pages are unchanged")
    b.add_argument("--max-tokens", type=int, default=256, help="longest validation reading")
    b.add_argument("--keep-best", action="store_true", help="keep the model of the lowest validation CER so far as "
                   "OUT/best (servable; `export --run OUT/best`)")
    b.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs; CPUs with avx512_bf16/AMX)")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    b.add_argument("--stop-after-s", type=float, default=0, help="end this call, evaluated and saved, at the first step "
                   "past this many seconds (a lent machine's time); the same command resumes the run (0: no limit)")
    b.add_argument("--workers", type=int, default=0, help="processes rendering the training pages ahead of the steps "
                   "(0: one thread; a GPU's steps need several); the decoder stage's cache is rendered by them too")
    e = sub.add_parser("export", help="copy a training run's model to a servable directory")
    e.add_argument("--run", default="runs/nano")
    e.add_argument("--to", default="weights/nano")
    e.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="precision of the stored weights "
                   "(bf16: half the size; the service still loads them at DTYPE, fp32 by default)")
    e.add_argument("--test-pages", type=int, default=64)
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--manifest", default=str(ROOT / "training_manifest.json"))
    s = sub.add_parser("ship", help="make a banked default (training/nano4.sh's bank step) the embedded one")
    s.add_argument("source", help="the banked directory (named nano: a base and its quantizer)")
    s.add_argument("--to", default=str(ROOT / "weights" / "nano"))
    s.add_argument("--bank-manifest", help="the records of the banked files (default: SOURCE/../manifest.json)")
    s.add_argument("--manifest", default=str(ROOT / "training_manifest.json"))
    q = sub.add_parser("quantizer", help="train the quantizer of a frozen base (resumable)")
    quantizer_trainer.add_arguments(q)
    q.add_argument("--manifest", default=str(ROOT / "training_manifest.json"))
    r = sub.add_parser("report", help="how closely the reading through the codes matches the uncompressed reading, "
                       "page by page, for any directory of images and PDFs (no transcripts needed)")
    self_reading.add_report_arguments(r)
    c = sub.add_parser("confidence", help="fit how far to trust readings and codes (confidence, fidelity) on held-out "
                       "pages of every kind, beside the quantizer")
    confidence.add_arguments(c)
    args = ap.parse_args(argv)
    if hasattr(args, "threads"):
        torch.set_num_threads(args.threads)
    {"base": train_base, "export": export_base, "quantizer": quantizer_trainer.train_quantizer,
     "report": self_reading.report, "ship": ship, "confidence": confidence.calibrate}[args.cmd](args)


if __name__ == "__main__":
    main()
