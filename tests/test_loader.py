"""The loader refuses what the decoder does not implement, and routes in fp32 whatever it serves in."""
import json
import shutil

import pytest
import torch

from conftest import ROOT, needs_shared, small_config
from ocr_latent.checkpoint import CheckpointError, build_modules, load_model, read_config
from ocr_latent.decoder import MoE

NANO = ROOT / "weights" / "nano"


@pytest.mark.parametrize("key, value", [
    ("topk_method", "group_limited_greedy"), ("norm_topk_prob", True), ("scoring_func", "sigmoid"),
    ("rope_scaling", {"type": "yarn", "factor": 4}), ("hidden_act", "gelu"), ("attention_bias", True),
    ("use_mla", True), ("kv_lora_rank", 512)])
def test_a_config_the_decoder_does_not_implement_is_refused_naming_the_key(tmp_path, key, value):
    model_dir = tmp_path / "model"
    shutil.copytree(NANO, model_dir)
    cfg = read_config(model_dir)
    cfg[key] = value
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"config.json: {key} is .*; this decoder implements only"):
        load_model(model_dir)


def test_the_configs_it_implements_load(nano_v1):
    for model_dir in (NANO, nano_v1):  # the default, and v1 before it (another depth, tokenizer and towers)
        layers = read_config(model_dir)["language_config"]["num_hidden_layers"]
        assert len(load_model(model_dir).decoder.layers) == layers
    assert read_config(nano_v1)["language_config"]["num_hidden_layers"] == 3
    build_modules(small_config())  # no routing keys at all: the code defaults


def test_deepseek_ocr_config_is_one_it_implements():
    cfg = json.loads(needs_shared("deepseek-ocr", "config.json").read_text())
    _, decoder = build_modules(cfg)
    assert decoder.cfg.n_routed_experts == 64 and decoder.cfg.num_experts_per_tok == 6


def test_the_router_runs_in_fp32_in_a_bf16_decoder():
    torch.manual_seed(0)
    moe = MoE(build_modules(small_config(), "cpu")[1].cfg)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(64, moe.gate.weight.shape[1]).to(torch.bfloat16)
    weight, expert = moe.route(x)
    probs = (x.float() @ moe.gate.weight.float().T).softmax(-1)  # the reference: fp32 logits and softmax
    top = probs.topk(moe.top_k, dim=-1)
    assert weight.dtype == torch.float32
    assert torch.equal(expert, top.indices.sort(-1).values)
    assert torch.allclose(weight.sum(-1), top.values.sum(-1), atol=1e-6)
