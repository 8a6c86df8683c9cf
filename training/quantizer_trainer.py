"""Training a quantizer for a frozen base: `python train.py quantizer` (options there).

Every base tensor stays as loaded (checked by a digest before writing anything); only the quantizer
learns, from three signals:
- the decoder's cross-entropy of the page text read through the rounded codes (straight-through),
- the KL divergence to the decoder's own reading of the uncompressed features (--distill),
- the relative error of the reconstructed features (--recon-weight), an auxiliary.

A run directory (--run) holds the quantizer, the optimiser and the curves; a stopped run resumes at
its last save. Rendered training pages are encoded once (features.py shards); a directory of
images with .txt transcripts (--data DIR) is encoded as it is read. With --targets self the text to
read is the base's own uncompressed reading of each page, of rendered pages or of any directory of
images and PDFs (self_reading.py), so no transcript is needed.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ocr_latent.training import features, self_reading
from ocr_latent.checkpoint import OCRModel, file_sha256, load_model
from ocr_latent.training.evaluation import evaluate, read_pages
from ocr_latent.training.losses import teacher_forced_logits
from ocr_latent.training.manifest import code_commit, curve_file, data_record, update_manifest
from ocr_latent.training.reading_metrics import cer
from ocr_latent.training.pages import PAGE_KINDS, PageMix, PageSpec, PageStream, load_corpus, split_documents, test_pages
from ocr_latent.serving.pipeline import base_fingerprint
from ocr_latent.quantizer import CrossTokenFSQ, FSQ, ScalarCodes, code_usage
from ocr_latent.training.recipe import code_fsq, code_geometry, cosine_to_tenth, training_device

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff")
IDENTITY = ("base_fingerprint", "geometry", "seed", "data", "targets", "pages", "more_text")  # what a resumed run must share


def base_digest(model: OCRModel) -> str:
    """sha256 over every tensor of the base (names, dtypes, shapes, bytes): equal only when bit-identical."""
    h = hashlib.sha256()
    for name, t in sorted({**{f"encoder.{k}": v for k, v in model.encoder.state_dict().items()},
                           **{f"decoder.{k}": v for k, v in model.decoder.state_dict().items()}}.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def held_out_spec(kind: str) -> PageSpec:
    """How held-out pages of a page kind are drawn: v1's small pages clean (the set the shipped quantizer reports
    on); any other kind as it is trained on, and of a mix (a curriculum level) its own pages alone, not the small
    pages mixed in, which the test reports apart."""
    if kind == "small":
        return PageSpec(augment=False)
    spec = PAGE_KINDS[kind]
    return spec.specs[0] if isinstance(spec, PageMix) else spec


def new_quantizer(args, model: OCRModel, mode: str) -> ScalarCodes:
    """A quantizer with the base's code geometry (recipe.code_geometry)."""
    if args.kind == "cross_token":
        return CrossTokenFSQ(*code_geometry(model, mode, args.levels), args.width, args.depth, args.heads, args.mlp_ratio)
    return code_fsq(model, mode, args.levels, args.hidden)


class TrainingData:
    """Batches of (features [B, T, D] fp32, texts), the same for a step on every run (resumable)."""

    def __init__(self, args, model: OCRModel, mode: str, docs: dict):
        self.args, self.model, self.mode = args, model, mode
        self.features = None
        own = args.targets == "self"
        if args.data == "pages":
            self.cache_dir = Path(args.cache_dir or Path(args.run) / "features")
            self.features, self.texts = features.load(model, args.cache_pages, args.cache_seed, self.cache_dir,
                                                      kind=args.pages, more_text=args.more_text, workers=args.workers)
            if own:  # the base's own reading of the same pages replaces their transcripts
                self.texts = self_reading.cached_reading(model, self.features, self.cache_dir / "own-reading.json",
                                                         args.target_max_tokens)
            self.record = data_record(docs, args.cache_seed, PAGE_KINDS[args.pages], {
                "train": f"{len(self.texts)} rendered pages of kind {args.pages} encoded once (features.py, stream seed "
                         f"{args.cache_seed}{', text from the train-only documents too' if args.more_text else ''})",
                "targets": "the frozen base's own greedy uncompressed reading" if own else "the pages' text",
                "draws": args.steps * args.batch, "val": args.val_pages, "test": args.eval_pages}, args.more_text)
        elif own:
            root = Path(args.data)
            self.features, names = self_reading.encode_directory(model, root, mode, Path(args.run) / "pages")
            self.texts = self_reading.cached_reading(model, self.features, Path(args.run) / "pages" / "own-reading.json",
                                                     args.target_max_tokens)
            self.record = {"dir": str(root), "pages": len(names), "files": len({n.split("#")[0] for n in names}),
                           "targets": "the frozen base's own greedy uncompressed reading", "draws": args.steps * args.batch}
        else:
            self.files = sorted(f for f in Path(args.data).iterdir()
                                if f.suffix.lower() in IMAGE_SUFFIXES and f.with_suffix(".txt").exists())
            if not self.files:
                raise SystemExit(f"--data {args.data}: no image files with a .txt transcript beside them "
                                 f"(or train on the base's own reading: --targets self)")
            self.texts = [f.with_suffix(".txt").read_text().strip() for f in self.files]
            self.record = {"dir": str(args.data), "pages": len(self.files), "draws": args.steps * args.batch}

    def batch(self, step: int) -> tuple[torch.Tensor, list[str]]:
        """Step `step`'s pages: a fresh permutation of all pages each epoch."""
        idx = features.epoch_batch(len(self.texts), self.args.batch, step, self.args.seed)
        if self.features is not None:
            feats = self.features[idx]
        else:
            from PIL import Image
            with torch.inference_mode():
                feats = self.model.encoder.encode_images([Image.open(self.files[i]) for i in idx], self.mode)
        return feats.to(self.args.device, torch.float32).clone(), [self.texts[i] for i in idx]


def losses(model: OCRModel, q: ScalarCodes, feats: torch.Tensor, texts: list[str], args) -> tuple[torch.Tensor, dict]:
    dtype = model.decoder.lm_head.weight.dtype
    recon = q(feats)
    with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits, target = teacher_forced_logits(model, [model.decoder.layout_image(r.to(dtype)) for r in recon], texts)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        row, loss = {"ce": ce.item()}, ce
        if args.distill:  # the frozen model reading the uncompressed features is the teacher
            with torch.no_grad():
                teacher, _ = teacher_forced_logits(model, [model.decoder.layout_image(f.to(dtype)) for f in feats], texts)
            scored = target != -100
            kl = F.kl_div(logits[scored].float().log_softmax(-1), teacher[scored].float().log_softmax(-1),
                          log_target=True, reduction="batchmean")
            row["kl"], loss = kl.item(), loss + args.distill * kl
    mse = F.mse_loss(recon, feats) / feats.var().clamp_min(1e-8)
    row["rel_mse"] = mse.item()
    return loss + args.recon_weight * mse, row


class Validation:
    """Greedy reading of held-out pages through the codes (their features are encoded once)."""

    def __init__(self, model: OCRModel, pages: list, mode: str, max_tokens: int = 256):
        self.model, self.pages, self.max_tokens = model, pages, max_tokens
        with torch.inference_mode():
            self.features = torch.cat([model.encoder.encode_images([p.image for p in pages[i:i + 16]], mode)
                                       for i in range(0, len(pages), 16)]) if pages else None

    @torch.inference_mode()
    def __call__(self, q: ScalarCodes | None) -> dict:
        d = self.model.decoder
        codes = q.encode(self.features) if q is not None else None
        feats = q.decode(codes) if q is not None else self.features
        hyps = read_pages(self.model, [d.layout_image(f.to(d.lm_head.weight.dtype)) for f in feats], self.max_tokens)
        out = {"cer": round(float(np.mean([cer(h, p.text) for h, p in zip(hyps, self.pages)])), 4)}
        if codes is not None:
            out["code_usage"] = code_usage(codes, q)
        return out


def save_state(run: Path, q: ScalarCodes, opt: torch.optim.Optimizer, meta: dict) -> None:
    """Quantizer + optimiser + curves, written to a temporary name and renamed: a kill never leaves half a save."""
    state = {f"q.{k}": v.detach().contiguous().cpu() for k, v in q.state_dict().items()}
    for i, p in enumerate(q.parameters()):
        for k, v in opt.state.get(p, {}).items():
            state[f"opt.{i}.{k}"] = v.detach().contiguous().cpu()
    run.mkdir(parents=True, exist_ok=True)
    save_file(state, str(run / "state.tmp"))
    (run / "run.tmp").write_text(json.dumps(meta, indent=1) + "\n")
    (run / "state.tmp").rename(run / "state.safetensors")
    (run / "run.tmp").rename(run / "run.json")


def resume(run: Path, q: ScalarCodes, opt: torch.optim.Optimizer, expect: dict) -> dict | None:
    if not (run / "run.json").exists():
        return None
    meta = json.loads((run / "run.json").read_text())
    shown = lambda v: "the default" if v is None else v if isinstance(v, str) else json.dumps(v)
    for key in IDENTITY:  # a field a run leaves out (targets, pages, more_text) is at its default; both ways
        if meta.get(key) != expect.get(key):
            raise SystemExit(f"--run {run} holds a run with {key} {shown(meta.get(key))}, not {shown(expect.get(key))}: "
                             f"resume it with its own settings or start another --run directory")
    state = load_file(str(run / "state.safetensors"))
    q.load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("q.")})
    for i, p in enumerate(q.parameters()):
        if f"opt.{i}.step" in state:
            opt.state[p] = {k: state[f"opt.{i}.{k}"].to(p.device) for k in ("step", "exp_avg", "exp_avg_sq")}
    return meta


def initialise(args, q: ScalarCodes, data: TrainingData) -> None:
    if args.init == "pca":
        if not isinstance(q, FSQ):
            raise SystemExit("--init pca is for --kind token; a cross-token quantizer starts from random or a file")
        q.init_from_pca(torch.cat([data.batch(i)[0] for i in range(args.pca_batches)]))
    elif args.init != "random":  # a quantizer file of the same geometry (a per-token one may lack the MLPs)
        start, _ = ScalarCodes.load(args.init)
        if start.kind != q.kind or start.levels != q.levels or start.tokens != q.tokens:
            raise SystemExit(f"--init {args.init}: geometry {start.geometry()} does not match {q.geometry()}")
        missing = q.load_state_dict(start.state_dict(), strict=False).missing_keys
        assert all(k.startswith("mlp_") for k in missing), missing


def train_quantizer(args) -> None:
    if args.kind == "cross_token" and args.hidden:
        raise SystemExit("--hidden is for --kind token; a cross-token quantizer's sizes are --width/--depth/--heads")
    training_device(args.device)
    args.init = args.init or ("pca" if args.kind == "token" else "random")
    torch.manual_seed(args.seed)
    out = Path(args.out or Path(args.base) / "quantizer.safetensors")
    args.run = str(args.run or out.with_suffix(".run"))
    run = Path(args.run)
    model = load_model(args.base, args.dtype, args.device)
    for p in [*model.encoder.parameters(), *model.decoder.parameters()]:
        p.requires_grad_(False)
    model.encoder.eval(), model.decoder.eval()
    frozen = base_digest(model)
    mode = model.config.get("ocr_latent", {}).get("mode", "base")
    docs = split_documents(load_corpus())
    q = new_quantizer(args, model, mode).to(args.device)
    opt = torch.optim.AdamW(q.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.grad_ckpt:  # recompute decoder layers in backward: activations of a 3B MoE are large
        for layer in model.decoder.layers:
            layer.forward = (lambda f: lambda *a, **k: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False, **k))(layer.forward)
    fingerprint = base_fingerprint(model)
    identity = {"base_fingerprint": fingerprint, "geometry": q.geometry(), "seed": args.seed, "data": args.data,
                **({"targets": "self"} if args.targets == "self" else {}),
                **({"pages": args.pages} if args.pages != "small" else {}), **({"more_text": True} if args.more_text else {})}
    meta = resume(run, q, opt, identity)  # before the data: a run resumed with other settings is refused at once
    data = TrainingData(args, model, mode, docs)
    if meta is None:
        initialise(args, q, data)
        meta = {**identity, "step": 0, "wall_s": 0.0, "curve": [], "val_curve": [], "code_commits": []}
    else:
        print(f"resuming {run} at step {meta['step']}")
    meta["code_commits"].append(code_commit())  # the code each (re)start read
    val = Validation(model, list(PageStream(docs["val"], held_out_spec(args.pages), seed=1, length=args.val_pages))
                     if args.data == "pages" else [], mode, args.max_tokens)
    if val.pages and "val_uncompressed" not in meta:
        meta["val_uncompressed"] = val(None)["cer"]

    step, t0 = meta["step"], time.time()
    bar = tqdm(total=args.steps, initial=step, desc="quantizer", dynamic_ncols=True)
    while step < args.steps:
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if args.decay:
            lr *= cosine_to_tenth(step / args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        feats, texts = data.batch(step)
        loss, row = losses(model, q, feats, texts, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(q.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in row.items()} | {"lr": f"{lr:.1e}"})
        meta["curve"].append({"step": step, **{k: round(v, 4) for k, v in row.items()}})
        if val.pages and (step % args.eval_every == 0 or step == args.steps):
            result = val(q)
            usage = result["code_usage"]
            meta["val_curve"].append({"step": step, "cer_codes": result["cer"], "cer_uncompressed": meta["val_uncompressed"],
                                      "dead_positions": usage["dead_positions"],
                                      "dim_entropy_bits_min": min(usage["dim_entropy_bits"]),
                                      "position_entropy_bits_mean": usage["position_entropy_bits_mean"]})
            tqdm.write(f"step {step}: val CER through codes {result['cer']:.4f} (uncompressed {meta['val_uncompressed']:.4f}); "
                       f"dead code positions {usage['dead_positions']}, dim entropy min "
                       f"{min(usage['dim_entropy_bits']):.2f} bits  ({time.time() - t0:.0f}s)")
        if step % args.save_every == 0 or step == args.steps:
            meta.update(step=step, wall_s=meta["wall_s"] + time.time() - t0, hyperparameters=hyperparameters(args))
            t0 = time.time()
            save_state(run, q, opt, meta)
    bar.close()
    finish(args, model, q, meta, data, docs, mode, frozen, out)


def test_metrics(model: OCRModel, q: ScalarCodes, test: list, mode: str, max_tokens: int) -> dict:
    plain, coded = (evaluate(model, test, mode, quantizer=quantizer, max_tokens=max_tokens) for quantizer in (None, q))
    return {"test_pages": len(test), "cer_uncompressed": round(plain["cer"], 4), "cer_codes": round(coded["cer"], 4),
            "wer_uncompressed": round(plain["wer"], 4), "wer_codes": round(coded["wer"], 4)}


def hyperparameters(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("cmd", "manifest")}


def finish(args, model, q, meta, data, docs, mode, frozen: str, out: Path) -> None:
    """Check the base is untouched, evaluate on held-out pages, write the quantizer and its record."""
    if base_digest(model) != frozen:
        raise SystemExit("a base tensor changed during quantizer training: nothing written")
    q.eval()
    metrics = {}
    if args.data == "pages" and args.eval_pages:
        metrics = test_metrics(model, q, list(test_pages(args.eval_pages, seed=2, spec=held_out_spec(args.pages))),
                               mode, args.max_tokens)
        if args.pages != "small":  # a base for other pages still owes v1's small pages what v1 reads of them
            metrics["small_pages"] = test_metrics(model, q, list(test_pages(args.eval_pages, seed=2)), mode, 256)
        print(json.dumps(metrics))
    curve_every = max(1, len(meta["curve"]) // 100)
    record = {"kind": f"{q.kind} FSQ quantizer (base frozen)", "base_model": model.name, "base_dir": str(args.base),
              "base_fingerprint": base_fingerprint(model), "base_state_sha256": frozen, "base_unchanged": True,
              "geometry": q.geometry(), "parameters": sum(p.numel() for p in q.parameters()),
              "steps": meta["step"], "wall_s": round(meta["wall_s"], 1),
              "sec_per_step": round(meta["wall_s"] / max(1, meta["step"]), 3),
              "peak_gpu_mem_gb": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                  if args.device.startswith("cuda") else None),
              "hyperparameters": hyperparameters(args), "data": data.record,
              "val_uncompressed_cer": meta.get("val_uncompressed"), "val_curve": meta["val_curve"],
              "code_usage": meta["val_curve"][-1] if meta["val_curve"] else None,
              "curve": meta["curve"][::curve_every],
              "final_metrics": metrics, "code_commit": meta["code_commits"][0],
              **({"code_commits": meta["code_commits"]} if len(set(meta["code_commits"])) > 1 else {})}
    q.cpu().save(out, {})
    record["weights_sha256"] = file_sha256(out)
    record["curve_file"] = curve_file(Path(args.manifest), f"{out.parent.name}-quantizer-{record['weights_sha256'][:12]}",
                                      {"curve": meta["curve"], "val_curve": meta["val_curve"]})
    digest = update_manifest(f"{out.parent.name}/quantizer", record, Path(args.manifest))
    q.save(out, {"base_model": model.name, "base_fingerprint": record["base_fingerprint"], "manifest_sha256": digest,
                 "final_metrics": metrics, "mode": mode})
    print(f"wrote {out} ({meta['wall_s']:.0f}s, {meta['wall_s'] / max(1, meta['step']):.2f}s/step"
          + (f", peak GPU memory {record['peak_gpu_mem_gb']} GiB" if record["peak_gpu_mem_gb"] else "") + ")")


def add_arguments(q) -> None:
    q.add_argument("--base", default="weights/nano", help="original-layout checkpoint directory (frozen)")
    q.add_argument("--out", help="default: BASE/quantizer.safetensors (+ its .json sidecar)")
    q.add_argument("--run", help="resumable run directory (default: OUT with the suffix .run)")
    q.add_argument("--data", default="pages", help="'pages' (rendered), or a directory: of images with .txt transcripts, "
                   "or with --targets self of any images and PDFs")
    q.add_argument("--targets", choices=["transcripts", "self"], default="transcripts",
                   help="self: the frozen base's own greedy uncompressed reading of each page, read once and cached "
                   "(no transcripts needed)")
    q.add_argument("--target-max-tokens", type=int, default=2048, help="--targets self: longest reading of a page")
    q.add_argument("--pages", choices=sorted(PAGE_KINDS), default="small",
                   help="--data pages: the kind of rendered pages (pages.PAGE_KINDS) trained on, validated and tested on "
                   "(a curriculum level's own pages, without the small pages it mixes in); for any kind but v1's small "
                   "pages the test reports those too")
    q.add_argument("--more-text", action="store_true", help="--data pages: the training pages' text is drawn from the "
                   "train-only documents too (held-out pages are unchanged)")
    q.add_argument("--max-tokens", type=int, default=256, help="longest reading of a validation or test page "
                   "(ordinary pages: 2048)")
    q.add_argument("--kind", choices=["cross_token", "token"], default="cross_token",
                   help="cross_token: attention across tokens on both sides; token: one linear map (+MLP) per token")
    q.add_argument("--width", type=int, default=192, help="cross_token: transformer width")
    q.add_argument("--depth", type=int, default=2, help="cross_token: blocks on each side")
    q.add_argument("--heads", type=int, default=4)
    q.add_argument("--mlp-ratio", type=int, default=2)
    q.add_argument("--hidden", type=int, default=0, help="token: width of residual MLPs around the projections (0: linear)")
    q.add_argument("--steps", type=int, default=400)
    q.add_argument("--batch", type=int, default=16)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--warmup", type=int, default=50)
    q.add_argument("--weight-decay", type=float, default=0.0)
    q.add_argument("--decay", action="store_true", help="cosine learning-rate decay to 10%%")
    q.add_argument("--levels", type=int, default=16)
    q.add_argument("--cache-pages", type=int, default=4096, help="rendered training pages, encoded once")
    q.add_argument("--cache-seed", type=int, default=1000, help="page stream of the rendered training pages")
    q.add_argument("--cache-dir", help="where their features live (default: RUN/features)")
    q.add_argument("--workers", type=int, default=0, help="processes rendering the pages to encode (0: one thread; "
                   "a GPU encodes faster than one CPU renders)")
    q.add_argument("--init", help="pca (token only), random, or a quantizer file to start from "
                   "(default: pca for token, random for cross_token)")
    q.add_argument("--pca-batches", type=int, default=4)
    q.add_argument("--recon-weight", type=float, default=0.5)
    q.add_argument("--distill", type=float, default=1.0,
                   help="weight of the KL divergence to the logits of the uncompressed features (one more forward a step)")
    q.add_argument("--val-pages", type=int, default=32)
    q.add_argument("--eval-every", type=int, default=250)
    q.add_argument("--save-every", type=int, default=50)
    q.add_argument("--eval-pages", type=int, default=64, help="held-out test pages read at the end")
    q.add_argument("--device", default="cpu")
    q.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    q.add_argument("--grad-ckpt", action="store_true")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=int, default=1)
