"""The nano model: DeepSeek-OCR's architecture at small widths (same code path: SAM -> CLIP ->
projector -> MoE decoder) with a character-level tokenizer, reading the rendered pages of pages.py.
Its files are the original checkpoint layout (checkpoint.save_model) plus its tokenizer."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ocr_latent.checkpoint import OCRModel, SpecialTokens, build_modules, init_weights, save_model
from ocr_latent.training.pages import CHARSET, CHARSET_LATIN1


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image>"]


FREE_PROMPT = "<image>\nFree OCR."


def nano_config(vocab_size: int, version: int = 1) -> dict:
    """A DeepSeek-OCR config.json (original layout) at nano sizes. Base mode: the 512 px page is
    letterboxed (here: scaled) to 1024 -> 16x16 tokens, each seeing 32x32 page pixels (about two
    characters of one line), the real model's 4096-code geometry (256 tokens x 16 dims). SAM uses
    windowed attention only: global attention over 64x64 patches is too slow to train on a CPU.

    Version 2 reads ordinary pages (1024 px, 18-40 px text: a glyph is one or two 16 px patches and
    a token's square holds several characters of two or three lines), so its towers are wider and
    deeper, its tokens wider before the projector, and its decoder one layer deeper with wider experts;
    the decoder stays 256 wide, so the code geometry (256 tokens x 16 dims) is unchanged."""
    language = {
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_size": 256,
        "intermediate_size": 512, "kv_lora_rank": None, "lm_head": True, "max_position_embeddings": 8192,
        "moe_intermediate_size": 128, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "rm_head": False, "topk_group": 1,
        "topk_method": "greedy", "use_mla": False, "v_head_dim": 0, "vocab_size": vocab_size}
    sam = {"downsample_channels": [128, 256], "global_attn_indexes": [], "heads": 2, "layers": 2, "width": 64,
           "neck_channels": 32}
    clip = {"heads": 4, "image_size": 224, "layers": 2, "patch_size": 14, "width": 256}
    if version == 2:
        language.update(num_hidden_layers=4, intermediate_size=768, moe_intermediate_size=192)
        sam = {**sam, "downsample_channels": [256, 384], "heads": 4, "layers": 4, "width": 128, "neck_channels": 64}
        clip = {**clip, "heads": 6, "width": 384}
    if version == 3:  # v1's widths, twice its SAM blocks and one more decoder layer: grown from a trained v1
        language.update(num_hidden_layers=4)
        sam = {**sam, "layers": 4}
    return {
        "_name_or_path": "ocr-latent/nano" if version == 1 else f"ocr-latent/nano-v{version}", "architectures": ["DeepseekOCRForCausalLM"],
        "candidate_resolutions": [[1024, 1024]], "global_view_pos": "head", "model_type": "deepseek_vl_v2",
        "language_config": {**language, "architectures": ["DeepseekV2ForCausalLM"], "torch_dtype": "float32"},
        "projector_config": {"input_dim": 2 * clip["width"], "model_type": "mlp_projector", "n_embed": 256,
                             "projector_type": "linear"},
        "tile_tag": "2D", "torch_dtype": "float32",
        "vision_config": {"image_size": 1024, "model_name": "deeplip_b_l", "model_type": "vision",
                          "width": {"clip-l-14-224": clip, "sam_vit_b": sam}},
        "ocr_latent": {"mode": "base", "prompt": FREE_PROMPT}, **language}


def char_tokenizer(charset: str = CHARSET):
    """Character-level tokenizer in tokenizers' format: specials, then '\\n' and the charset
    (printable ASCII; version 2 adds the Latin-1 letters after them)."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["\n"] + list(charset))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    return tok


def tokenizer_config(tok) -> dict:
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for s in SPECIALS}
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
            "pad_token": SPECIALS[2], "added_tokens_decoder": added, "tokenizer_class": "PreTrainedTokenizerFast"}


def model_charset(model: OCRModel) -> str:
    """The characters a nano tokenizer spells (one token each), in token order: what its dense
    per-token losses classify."""
    vocab = model.tokenizer.get_vocab()
    return "".join(t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) == 1 and t != "\n")


def spells_by_character(model: OCRModel, text: str) -> bool:
    """Whether the model's tokenizer writes `text` one token a character, as the per-character benches and the
    pointer targets assume (a letter outside its charset breaks it)."""
    return len(model.tokenizer.encode(text, add_special_tokens=False).ids) == len(text)


def new_nano(seed: int, version: int = 1) -> OCRModel:
    tok = char_tokenizer(CHARSET if version == 1 else CHARSET_LATIN1)
    cfg = nano_config(tok.get_vocab_size(), version)
    encoder, decoder = build_modules(cfg, "cpu")
    init_weights(encoder, decoder, seed=seed)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    tokens = SpecialTokens(bos=ids[SPECIALS[0]], eos=ids[SPECIALS[1]], pad=ids[SPECIALS[2]], image=ids["<image>"])
    return OCRModel(cfg, encoder, decoder, tokens, tok)


@torch.no_grad()
def grown_nano(v1: OCRModel, seed: int) -> OCRModel:
    """Nano v3, started from a trained v1 rather than from scratch (v2's towers, trained from scratch on
    ordinary pages, had learned next to no glyphs after 950 steps): v1's weights, a new SAM block before
    each of v1's and a fourth decoder layer, each new block's output projections zero so that it starts as
    the identity (the grown model reads as v1 does), and the Latin-1 tokenizer, whose new rows start as
    random rows of the old rows' scale. The new depth and rows learn on ordinary pages."""
    grown = new_nano(seed, version=3)
    old_blocks, new_blocks = v1.encoder.sam_model.blocks, grown.encoder.sam_model.blocks
    for i, block in enumerate(new_blocks):
        if i % 2:  # blocks 1, 3 are v1's 0, 1
            block.load_state_dict(old_blocks[i // 2].state_dict())
        else:
            for linear in (block.attn.proj, block.mlp.lin2):
                linear.weight.zero_(), linear.bias.zero_()
    kept = {k: v for k, v in v1.encoder.state_dict().items() if not k.startswith("sam_model.blocks.")}
    grown.encoder.load_state_dict(kept, strict=False)
    old_layers = v1.decoder.layers
    for i, layer in enumerate(grown.decoder.layers):
        if i < len(old_layers):
            layer.load_state_dict(old_layers[i].state_dict())
        else:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.w_down.zero_(), layer.mlp.shared_experts.down_proj.weight.zero_()
    targets = grown.decoder.state_dict()
    for name, value in v1.decoder.state_dict().items():
        if name.startswith("layers."):
            continue
        target = targets[name]
        if name in ("embed_tokens.weight", "lm_head.weight"):  # same ids for v1's tokens; new ones after them
            n = value.shape[0]
            target[:n] = value
            target[n:] = torch.randn(target[n:].shape, generator=torch.Generator().manual_seed(seed)) * value.std()
        else:
            target.copy_(value)
    grown.config["ocr_latent"] = dict(v1.config.get("ocr_latent", {}))
    return grown


def split_inputs(weight: torch.Tensor, gen: torch.Generator, dim: int = 1) -> torch.Tensor:
    """A layer reading channels that were duplicated ([x, x]): each weight is split between the two copies
    at a random share, so the layer computes the same function while the copies, read with different
    weights, get different gradients and learn apart (Net2WiderNet's symmetry breaking, without its noise)."""
    share = 0.25 + 0.5 * torch.rand(weight.shape, generator=gen)
    return torch.cat([weight * share, weight * (1 - share)], dim)


def duplicate_outputs(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """A layer writing duplicated channels: its rows twice, so that every copy carries the same value
    (a LayerNorm over [x, x] gives [LN(x), LN(x)])."""
    return torch.cat([tensor, tensor], dim)


def duplicate_heads(qkv: torch.Tensor) -> torch.Tensor:
    """A fused q, k, v projection's rows (or bias) with each of q, k and v writing its heads twice."""
    return torch.cat([duplicate_outputs(part) for part in qkv.chunk(3)])


def widened_sam(old: dict[str, torch.Tensor], gen: torch.Generator, wider_input: bool, wider_output: bool) -> dict:
    """SAM's weights at twice its width, heads, neck and first downsampling conv (wider_input), and/or with
    its last conv writing each channel twice (wider_output: a wider CLIP reads it)."""
    new = {}
    for name, value in old.items():
        if name == "net_3.weight":
            value = split_inputs(value, gen) if wider_input else value
            new[name] = duplicate_outputs(value) if wider_output else value
        elif not wider_input:
            new[name] = value
        elif name.endswith(("rel_pos_h", "rel_pos_w")):  # per head dimension: unchanged
            new[name] = value
        elif name == "pos_embed":
            new[name] = duplicate_outputs(value, -1)
        elif name.endswith("attn.qkv.weight"):
            new[name] = duplicate_heads(split_inputs(value, gen))
        elif name.endswith("attn.qkv.bias"):
            new[name] = duplicate_heads(value)
        elif name.endswith(("attn.proj.weight", "mlp.lin1.weight", "mlp.lin2.weight")) or name in ("neck.0.weight", "neck.2.weight", "net_2.weight"):
            new[name] = duplicate_outputs(split_inputs(value, gen))
        elif name.startswith("patch_embed.") or name.endswith(("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.proj.bias",
                                                                "mlp.lin1.bias", "mlp.lin2.bias")) or name.startswith(("neck.1.", "neck.3.")):
            new[name] = duplicate_outputs(value)
        else:
            raise KeyError(f"widened_sam does not know how to widen {name}")
    return new


def widened_clip(old: dict[str, torch.Tensor], gen: torch.Generator) -> dict:
    """CLIP's weights at twice its width and heads (the head dimension, and so the attention, unchanged)."""
    new = {}
    for name, value in old.items():
        if name == "embeddings.position_embedding.weight":
            new[name] = duplicate_outputs(value, 1)
        elif name.endswith("qkv_proj.weight"):
            new[name] = duplicate_heads(split_inputs(value, gen))
        elif name.endswith("qkv_proj.bias"):
            new[name] = duplicate_heads(value)
        elif name.endswith(("out_proj.weight", "fc1.weight", "fc2.weight")):
            new[name] = duplicate_outputs(split_inputs(value, gen))
        elif name.endswith(("class_embedding", "patch_embedding.weight", ".bias")) or "layer_norm" in name or "layrnorm" in name:
            new[name] = duplicate_outputs(value)
        else:
            raise KeyError(f"widened_clip does not know how to widen {name}")
    return new


@torch.no_grad()
def widened_nano(narrow: OCRModel, seed: int, towers: tuple[str, ...] = ("sam",)) -> OCRModel:
    """A trained nano with wider towers, computing the same function: every widened channel starts as two
    copies of the old one. "sam": SAM's width, heads, neck and first downsampling conv doubled (nano v4
    is v3 so widened): glyphs of ordinary text are one or two 16 px patches, which v3's 64-wide patches
    and 32-channel neck carry poorly. "clip": SAM's last conv, CLIP's width and heads and the projector's
    input doubled, so each vision token carries more of the several characters in its square. The
    projector's output and the decoder are the narrow model's own."""
    if not towers or not set(towers) <= {"sam", "clip"}:
        raise ValueError(f"towers to widen: sam, clip or both, not {towers}")
    gen = torch.Generator().manual_seed(seed)
    cfg = copy.deepcopy(narrow.config)
    sam, clip = (cfg["vision_config"]["width"][k] for k in ("sam_vit_b", "clip-l-14-224"))
    c2, c3 = sam["downsample_channels"]
    if "sam" in towers:
        sam.update(width=2 * sam["width"], heads=2 * sam["heads"], neck_channels=2 * sam.get("neck_channels", 256))
        c2 *= 2
    if "clip" in towers:
        c3 *= 2
        clip.update(width=2 * clip["width"], heads=2 * clip["heads"])
        cfg["projector_config"]["input_dim"] *= 2
    sam["downsample_channels"] = [c2, c3]
    name = cfg.get("_name_or_path", "nano")
    cfg["_name_or_path"] = "ocr-latent/nano-v4" if name == "ocr-latent/nano-v3" and towers == ("sam",) else f"{name}-wide"
    encoder, decoder = build_modules(cfg, "cpu")
    encoder.sam_model.load_state_dict(widened_sam(narrow.encoder.sam_model.state_dict(), gen, "sam" in towers, "clip" in towers))
    clip_state, projector = narrow.encoder.vision_model.state_dict(), narrow.encoder.projector.state_dict()
    if "clip" in towers:  # the projector reads [CLIP, SAM], each now in two copies
        clip_state = widened_clip(clip_state, gen)
        weight = projector["layers.weight"]
        width = weight.shape[1] // 2
        projector["layers.weight"] = torch.cat([split_inputs(weight[:, :width], gen), split_inputs(weight[:, width:], gen)], 1)
    encoder.vision_model.load_state_dict(clip_state)
    encoder.projector.load_state_dict(projector)
    decoder.load_state_dict(narrow.decoder.state_dict())
    return OCRModel(cfg, encoder, decoder, narrow.tokens, narrow.tokenizer)


def save_run(model: OCRModel, out: Path, extra: dict[str, torch.Tensor] | None = None,
             dtype: torch.dtype = torch.float32) -> None:
    save_model(model, out, dtype)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model.tokenizer), indent=1) + "\n")
    if extra:
        save_file({k: v.detach().contiguous() for k, v in extra.items()}, str(out / "train_state.safetensors"))


# Nano v1, the default until nano v4 replaced it (3 decoder layers, ASCII, 512 px pages of large print): what the
# v4 chain grows from and what the benches of its pointer head measure. The tree holds one default (the working
# tree a device machine takes is 64 MiB); v1 is read from the commit that shipped it.
V1_COMMIT = "d94d9b634e0ae7b3578b64e115f5593646990d67"
# what a default's directory holds (weights/nano): the base in the original layout, its tokenizer, its quantizer
DEFAULT_FILES = ("config.json", "model-00001-of-000001.safetensors", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "quantizer.safetensors", "quantizer.json")


def shipped_v1(dest: Path) -> Path:
    """Write nano v1's files, as shipped, to `dest` (kept if already there) and return it. Needs the repository's
    history: a shallow clone lacks the commit, and the error says how to fetch it."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    if all((dest / name).exists() for name in DEFAULT_FILES):
        return dest
    found = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{V1_COMMIT}^{{commit}}"], capture_output=True)
    if found.returncode:
        raise FileNotFoundError(f"nano v1 is read from commit {V1_COMMIT[:12]} of this repository, which this clone "
                                f"lacks (a shallow clone?); run `git fetch --unshallow` in {root}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in DEFAULT_FILES:  # each file complete before the next, and the set complete only once the last is there
        blob = subprocess.run(["git", "-C", str(root), "show", f"{V1_COMMIT}:weights/nano/{name}"], capture_output=True,
                              check=True).stdout
        tmp = dest / f".{name}.tmp"
        tmp.write_bytes(blob)
        tmp.rename(dest / name)
    return dest


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Write nano v1, the default before v4, from this repository's history.")
    ap.add_argument("--v1-to", type=Path, required=True, help="directory to write it to")
    print(shipped_v1(ap.parse_args().v1_to))
