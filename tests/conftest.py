from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

from ocr_latent.checkpoint import build_modules, init_weights


def needs_shared(*parts: str) -> Path:
    """Path under ../shared, or skip: a user's clone has no ../shared (fixtures of the team's CI)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared (parity fixtures, real config) is only beside the team's checkout")
    return path


def small_config(vocab: int = 300, experts: int = 8, top_k: int = 3, layers: int = 3) -> dict:
    """A DeepSeek-OCR config.json in the original layout at toy sizes (CLIP width = SAM output)."""
    language = {"bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_size": 64,
                "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": experts,
                "n_shared_experts": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                "num_experts_per_tok": top_k, "num_hidden_layers": layers, "vocab_size": vocab}
    return {"_name_or_path": "test/small", "language_config": dict(language), **language,
            "projector_config": {"input_dim": 128, "n_embed": 64, "projector_type": "linear"},
            "vision_config": {"image_size": 1024, "width": {
                "clip-l-14-224": {"heads": 2, "layers": 1, "width": 64, "image_size": 224, "patch_size": 14},
                "sam_vit_b": {"downsample_channels": [32, 64], "global_attn_indexes": [1], "heads": 2,
                              "layers": 2, "width": 32, "neck_channels": 16}}}}


@pytest.fixture(scope="session")
def small_modules():
    torch.manual_seed(0)
    encoder, decoder = build_modules(small_config(), "cpu")
    init_weights(encoder, decoder, seed=1, std=0.1)
    return encoder.eval(), decoder.eval()
