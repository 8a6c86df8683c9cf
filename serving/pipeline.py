"""The two halves of the product around a loaded base model and its trained quantizer.

encode: page images -> DeepEncoder features -> FSQ codes [B, 4096] (uint8, 0..15)
decode: codes -> dequantized features -> image embeddings laid out as DeepSeek-OCR does -> decoder
inputs; generation itself runs on a `generation.Generator` owned by the caller (the server's worker).
Nothing but the codes and the prompt crosses from encode to decode.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ocr_latent.architecture import ARCHITECTURE, GENERATION, NUM_CODES, PROMPTS, ROOT
from ocr_latent.checkpoint import DTYPES, CheckpointError, OCRModel, load_model, verify_pin
from ocr_latent.generation import Generator, RepetitionRule
from ocr_latent.quantizer import ScalarCodes
from ocr_latent.serving.confidence import Calibration, calibration_path
from ocr_latent.serving.settings import settings


def base_fingerprint(model: OCRModel) -> str:
    """Identifies a base model's weights cheaply: its config plus the projector it feeds the codes from."""
    h = hashlib.sha256(json.dumps(model.config, sort_keys=True).encode())
    weight, stored = model.encoder.projector.layers.weight.detach(), model.stored_projector
    # loaded at a lower precision than stored (fp32 nano served in bf16): the file's values, unless
    # the weight has changed since loading
    if stored is not None and torch.equal(stored.to(weight.device, weight.dtype), weight):
        weight = stored
    h.update(weight.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def default_prefill_dtype(device: str, dtype: str) -> str:
    """bf16 prompts for an fp32 model on a CPU with native bf16 (see generation.Generator); else the model's dtype."""
    return "bf16" if device == "cpu" and DTYPES[dtype] == torch.float32 and native_bf16_cpu() else dtype


class Pipeline:
    def __init__(self, model: OCRModel, quantizer: ScalarCodes, mode: str, label: str, revision: str,
                 prefill_dtype: str | None = None, calibration: Calibration | None = None):
        # what the codes mean (codes files carry it): taken before the quantizer moves to the device
        self.quantizer_fingerprint = quantizer.fingerprint(base_fingerprint(model))
        self.model, self.quantizer, self.mode = model, quantizer.to(model.encoder.projector.layers.weight.device), mode
        self.label, self.revision = label, revision
        # how far to trust readings and codes (serving/confidence.py): used only when fitted for this quantizer
        self.calibration = calibration if calibration and calibration.quantizer == self.quantizer_fingerprint else None
        decoder = model.decoder
        self.prefill_dtype = DTYPES[prefill_dtype] if prefill_dtype else decoder.lm_head.weight.dtype
        # a copy of the decoder at the prompt precision, when it differs (its own weights: a 22 MB bf16 copy for nano)
        self.prefill_decoder = (copy.deepcopy(decoder).to(self.prefill_dtype)
                                if self.prefill_dtype != decoder.lm_head.weight.dtype else decoder)
        self.device = str(model.encoder.projector.layers.weight.device)
        prompts = PROMPTS if model.tokenizer is not None else {}
        # prompts the model's tokenizer can spell ("markdown" needs <|grounding|> as one token)
        self.prompts = {k: model.prompt_ids(p) for k, p in prompts.items() if self._spellable(p)}
        self.rule = RepetitionRule(**GENERATION["repetition"], exempt=frozenset(model.tokens.td))
        self._prompt_lengths: dict[str, int] = {}

    def _spellable(self, prompt: str) -> bool:
        special = [t for t in ("<|grounding|>",) if t in prompt]
        return all(self.model.tokenizer.token_to_id(t) is not None for t in special)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> np.ndarray:
        """Pages -> codes [B, NUM_CODES] uint8; one batched forward through the towers."""
        return self.quantizer.encode(self.model.encoder.encode_images(images, self.mode)).cpu().numpy()

    @torch.inference_mode()
    def encode_measured(self, images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """Pages -> (codes [B, NUM_CODES] uint8, lost [B]): `lost` is the share of each page's feature energy
        that its codes do not carry back (|f - dequantized|^2 / |f|^2), the input of `fidelity`."""
        return self.measure(self.model.encoder.encode_images(images, self.mode))

    @torch.inference_mode()
    def measure(self, feats: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The towers' features [B, T, D] -> encode_measured's (codes, lost)."""
        codes = self.quantizer.encode(feats)
        back = self.quantizer.decode(codes).float()
        lost = ((feats - back) ** 2).sum((1, 2)) / (feats ** 2).sum((1, 2)).clamp(min=1e-12)
        return codes.cpu().numpy(), lost.cpu().numpy()

    def fidelity(self, lost: float) -> float | None:
        """How faithfully a page's codes carry it for the decoder (0..1), or None without a calibration."""
        return None if self.calibration is None else round(self.calibration.fidelity(lost), 4)

    def confidence(self, logprobs: list[float], finish_reason: str, codes: np.ndarray) -> float | None:
        """How far to trust a reading (0..1), or None without a calibration (`train.py confidence` fits one)."""
        if self.calibration is None:
            return None
        return round(self.calibration.confidence(logprobs, finish_reason, codes), 4)

    @torch.inference_mode()
    def decode_inputs(self, codes: np.ndarray, prompt: str) -> torch.Tensor:
        """Codes [NUM_CODES] + prompt name -> decoder input embeddings [L, D]."""
        d = self.model.decoder
        feats = self.quantizer.decode(torch.as_tensor(codes, dtype=torch.uint8, device=d.lm_head.weight.device)[None])[0]
        return d.build_inputs(d.layout_image(feats.to(d.lm_head.weight.dtype)), self.prompts[prompt], self.model.tokens.bos)

    def new_generator(self, slots: int, kv_tokens: int | None = None, compile: bool = False, **options) -> Generator:
        """`options`: Generator's others (device_rule, overlap, cuda_graphs...), for tests and benchmarks."""
        return Generator(self.model.decoder, slots, self.model.tokens.eos, self.rule, self.prefill_decoder,
                         kv_tokens=kv_tokens, compile=compile, **options)

    def prompt_length(self, prompt: str) -> int:
        """Decoder input positions of a page with `prompt` (image tokens, separators, BOS, prompt): the
        same for every page of a mode."""
        if prompt not in self._prompt_lengths:
            self._prompt_lengths[prompt] = self.decode_inputs(np.zeros(NUM_CODES, np.uint8), prompt).shape[0]
        return self._prompt_lengths[prompt]

    def text(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    def raw_text(self, tokens: list[int]) -> str:
        """Tokens as they are, unstripped (pieces of a text being streamed)."""
        return self.model.tokenizer.decode(tokens, skip_special_tokens=False)


def load_quantizer(path: Path, model: OCRModel, model_dir: str | Path = "MODEL_DIR") -> tuple[ScalarCodes, dict]:
    if not path.exists():
        raise CheckpointError(f"quantizer {path} not found: train one with `python train.py quantizer --base "
                              f"{model_dir} --out {path}` or point QUANTIZER= at a trained one")
    fsq, meta = ScalarCodes.load(path)
    expected = base_fingerprint(model)
    if meta.get("base_fingerprint") != expected:
        raise CheckpointError(f"quantizer {path} was trained for base {meta.get('base_model')!r} "
                              f"(fingerprint {meta.get('base_fingerprint')}), not for the loaded base "
                              f"{model.name!r} (fingerprint {expected}): train a quantizer for this base with "
                              f"`python train.py quantizer --base {model_dir}`")
    if fsq.num_codes != NUM_CODES or fsq.embed_dim != model.decoder.cfg.hidden_size:
        raise CheckpointError(f"quantizer {path} makes {fsq.num_codes} codes of width {fsq.embed_dim}; "
                              f"this service needs {NUM_CODES} for embeddings of width {model.decoder.cfg.hidden_size}")
    return fsq, meta


def load_pipeline(model_dir: str | None = None, quantizer: str | None = None, device: str = "cpu",
                  dtype: str = "float32", prefill_dtype: str | None = None, verify: bool | None = None) -> Pipeline:
    """MODEL_DIR unset: the embedded nano model (weights/nano). Else an original-layout DeepSeek-OCR
    directory with the quantizer trained for it (weights/deepseek-ocr/ by default). Prompts are
    prefilled at `prefill_dtype` (default: default_prefill_dtype). `verify`: check MODEL_DIR's sha256
    against architecture.json's pin (default: VERIFY_PIN=1)."""
    if model_dir is None:
        model_dir, label = str(ROOT / "weights" / "nano"), "nano"
    else:
        label = Path(model_dir).name
        if settings().verify_pin if verify is None else verify:
            verify_pin(model_dir, ARCHITECTURE["base_model"]["pin"])
    model = load_model(model_dir, dtype, device)
    # a checkpoint in nano format (weights/nano or a copy) names its own mode; the rest is DeepSeek-OCR
    base = ARCHITECTURE["nano"] if "ocr_latent" in model.config else ARCHITECTURE["base_model"]
    default_quantizer = Path(model_dir) / "quantizer.safetensors" if "ocr_latent" in model.config else ROOT / base["quantizer"]
    quantizer_path = Path(quantizer or default_quantizer)
    fsq, _ = load_quantizer(quantizer_path, model, model_dir)
    mode = model.config.get("ocr_latent", {}).get("mode", base["mode"])
    calibrated = calibration_path(quantizer_path)
    calibration = Calibration.load(calibrated) if calibrated.exists() else None
    return Pipeline(model, fsq, mode, label, base["revision"], prefill_dtype or default_prefill_dtype(device, dtype),
                    calibration)
