"""Load and save DeepSeek-OCR checkpoints in their original layout.

A checkpoint directory holds `config.json` (original format), safetensors shards with the original
key names (plus `model.safetensors.index.json` when sharded or published that way) and, when
present, `tokenizer.json` / `tokenizer_config.json`. Modules are built on the meta device and the
file tensors assigned into them (no double allocation). Only safetensors are read; nothing is
unpickled and no remote code runs.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ocr_latent.architecture import DTYPE_NAMES
from ocr_latent.decoder import Decoder, DecoderConfig, RMSNorm
from ocr_latent.encoder import DeepEncoder, LayerNorm2d, VisionConfig

ENCODER_PREFIXES = ("model.sam_model.", "model.vision_model.", "model.projector.")
EXPERT_KEY = re.compile(r"(layers\.\d+\.mlp\.)experts\.(\d+)\.(gate|up|down)_proj\.weight$")
DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


class CheckpointError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- key mapping
def split_key(name: str) -> tuple[str, str]:
    """Original checkpoint name -> ("encoder" | "decoder", name inside that module, experts unstacked)."""
    if name.startswith(ENCODER_PREFIXES):
        return "encoder", name[len("model."):]
    if name.startswith("model."):
        return "decoder", name[len("model."):]
    if name.startswith("lm_head."):
        return "decoder", name
    raise CheckpointError(f"unexpected tensor name {name!r}")


def checkpoint_state(encoder: DeepEncoder, decoder: Decoder) -> dict[str, torch.Tensor]:
    """Our modules' tensors under the original checkpoint names (stacked experts split per expert)."""
    out = {}
    for name, t in encoder.state_dict().items():
        out["model." + name] = t
    for name, t in decoder.state_dict().items():
        if m := re.match(r"(layers\.\d+\.mlp\.)w_(gate|up|down)$", name):
            for e in range(t.shape[0]):
                out[f"model.{m[1]}experts.{e}.{m[2]}_proj.weight"] = t[e]
        else:
            out[name if name.startswith("lm_head.") else "model." + name] = t
    return out


# ----------------------------------------------------------------------------- special tokens
@dataclass
class SpecialTokens:
    bos: int
    eos: int
    pad: int | None = None
    image: int | None = None
    td: tuple[int, ...] = ()  # exempt from the no-repeat-n-gram ban

    @classmethod
    def from_files(cls, model_dir: Path, cfg: dict) -> "SpecialTokens":
        path = model_dir / "tokenizer_config.json"
        if not path.exists():  # e.g. the parity fixture: ids from config.json only
            return cls(bos=cfg.get("bos_token_id", 0), eos=cfg.get("eos_token_id", 1))
        tc = json.loads(path.read_text())
        ids = {v["content"]: int(k) for k, v in tc.get("added_tokens_decoder", {}).items()}
        content = lambda t: t["content"] if isinstance(t, dict) else t
        find = lambda key: ids.get(content(tc[key])) if tc.get(key) else None
        return cls(bos=find("bos_token"), eos=find("eos_token"), pad=find("pad_token"), image=ids.get("<image>"),
                   td=tuple(ids[t] for t in ("<td>", "</td>") if t in ids))


# ----------------------------------------------------------------------------- the model
@dataclass
class OCRModel:
    config: dict
    encoder: DeepEncoder
    decoder: Decoder
    tokens: SpecialTokens
    tokenizer: object | None  # tokenizers.Tokenizer when tokenizer.json is present
    # the projector weight as the file stores it, kept (fp32, on the CPU) when loading cast it to a
    # lower precision: a quantizer names its base by these values, whatever dtype serves it
    stored_projector: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.config.get("_name_or_path", "unknown")

    def prompt_ids(self, prompt: str) -> list[int]:
        """'<image>\\n...' -> ids of the text after the image (BOS and image positions are added by
        Decoder.build_inputs). Text pieces are encoded without special tokens, as upstream does."""
        before, image, after = prompt.partition("<image>")
        if before.strip() or not image:
            raise ValueError("prompts start with a single <image>")
        if self.tokenizer is None:
            raise CheckpointError("this checkpoint has no tokenizer.json")
        return self.tokenizer.encode(after, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        if ids and ids[-1] == self.tokens.eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False).strip()


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} not found: a checkpoint directory needs config.json")
    return json.loads(path.read_text())


def build_modules(cfg: dict, device: str | torch.device = "meta") -> tuple[DeepEncoder, Decoder]:
    try:
        decoder_config = DecoderConfig.from_config(cfg)
    except ValueError as e:  # a value this decoder does not implement: refused before any weight is read
        raise CheckpointError(str(e)) from None
    with torch.device(device):
        return DeepEncoder(VisionConfig.from_config(cfg)), Decoder(decoder_config)


@torch.no_grad()
def init_weights(*modules: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fresh weights for training from scratch or tests: N(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator().manual_seed(seed)
    norms = (torch.nn.LayerNorm, LayerNorm2d, RMSNorm)
    for module in modules:
        for name, p in module.named_parameters():
            p.copy_(torch.zeros_like(p) if name.endswith(".bias") else torch.randn(p.shape, generator=gen) * std)
        for m in module.modules():
            if isinstance(m, norms):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {model_dir}")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> OCRModel:
    model_dir = Path(model_dir)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cfg = read_config(model_dir)
    encoder, decoder = build_modules(cfg)
    expected = {n: t.shape for n, t in checkpoint_state(encoder, decoder).items()}
    states: dict[str, dict] = {"encoder": {}, "decoder": {}}
    experts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    found, bad_shape, stored_projector = set(), [], None
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                found.add(name)
                if name not in expected:
                    continue
                t = f.get_tensor(name)
                if t.shape != expected[name]:
                    bad_shape.append(f"{name}: file {tuple(t.shape)} vs config {tuple(expected[name])}")
                    continue
                part, key = split_key(name)
                if key == "projector.layers.weight" and not torch.equal(t.to(dtype).to(t.dtype), t):
                    stored_projector = t.float()
                t = t.to(device=device, dtype=dtype)
                if m := EXPERT_KEY.search(key):
                    experts[f"{m[1]}w_{m[3]}"][int(m[2])] = t
                else:
                    states[part][key] = t
    missing, unexpected = sorted(set(expected) - found), sorted(found - set(expected))
    if missing or unexpected or bad_shape:
        show = lambda xs: ", ".join(xs[:20]) + (f" ... ({len(xs)} in all)" if len(xs) > 20 else "")
        raise CheckpointError(f"checkpoint {model_dir} does not match its config.json:"
                              + (f"\n  missing: {show(missing)}" if missing else "")
                              + (f"\n  unexpected: {show(unexpected)}" if unexpected else "")
                              + (f"\n  wrong shape: {show(bad_shape)}" if bad_shape else ""))
    for key, per_expert in experts.items():  # per-expert matrices -> one stacked parameter
        states["decoder"][key] = torch.stack([per_expert[e] for e in range(len(per_expert))])
        per_expert.clear()
    encoder.load_state_dict(states["encoder"], strict=True, assign=True)
    decoder.load_state_dict(states["decoder"], strict=True, assign=True)
    tokenizer = None
    if (model_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return OCRModel(cfg, encoder.eval(), decoder.eval(), SpecialTokens.from_files(model_dir, cfg), tokenizer,
                    stored_projector)


def save_model(model: OCRModel, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write `model` in the original layout (config.json, one shard + index, tokenizer files)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in checkpoint_state(model.encoder, model.decoder).items()}
    shard = "model-00001-of-000001.safetensors"
    save_file(state, str(out / shard), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: shard for k in sorted(state)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(model.config, indent=1) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save(str(out / "tokenizer.json"))


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_pin(model_dir: str | Path, pin: dict) -> None:
    """Check the weights file against architecture.json's pin (size first: hashing 6.7 GB takes a while)."""
    path = Path(model_dir) / pin["file"]
    if not path.exists():
        raise CheckpointError(f"{path} not found (pinned weights file)")
    if path.stat().st_size != pin["size"]:
        raise CheckpointError(f"{path}: size {path.stat().st_size} != pinned {pin['size']}")
    if (digest := file_sha256(path)) != pin["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest} != pinned {pin['sha256']}")
