"""The cross-token quantizer, and training it with the whole base frozen (nano, and the original-format
parity checkpoint trained then served)."""
import base64
import json
import shutil

import httpx
import pytest
import torch

from ocr_latent.training import quantizer_trainer as quantizer_training
from ocr_latent import train
from ocr_latent.checkpoint import load_model
from conftest import ROOT, Server, needs_shared
from ocr_latent.training.pages import PageSpec, PageStream, load_corpus, split_documents
from ocr_latent.quantizer import FSQ, CrossTokenFSQ, ScalarCodes, code_usage

NANO = ROOT / "weights" / "nano"


def small_cross(seed: int = 0) -> CrossTokenFSQ:
    torch.manual_seed(seed)
    return CrossTokenFSQ(embed_dim=64, tokens=16, levels=[16] * 4, width=32, depth=1, heads=2)


# ----------------------------------------------------------------------------- the quantizer
def test_cross_token_codes_are_4_bit_and_a_saved_file_rebuilds_the_same_quantizer(tmp_path):
    q = small_cross()
    feats = torch.randn(3, 16, 64) * 3
    codes = q.encode(feats)
    assert codes.shape == (3, 64) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert len(torch.unique(codes)) > 8  # an untrained compressor already spreads over the levels
    assert q.decode(codes).shape == (3, 16, 64)
    q.save(tmp_path / "q.safetensors", {"note": "test"})
    sidecar = json.loads((tmp_path / "q.json").read_text())
    assert sidecar["kind"] == "cross_token" and (sidecar["width"], sidecar["depth"], sidecar["heads"]) == (32, 1, 2)
    loaded, meta = ScalarCodes.load(tmp_path / "q.safetensors")
    assert isinstance(loaded, CrossTokenFSQ) and meta["note"] == "test"
    assert torch.equal(loaded.encode(feats), codes) and torch.equal(loaded.decode(codes), q.decode(codes))
    old_style = FSQ(64, 16, [16] * 4)  # a per-token file without "kind" (written before there were two)
    old_style.save(tmp_path / "t.safetensors", {})
    sidecar = json.loads((tmp_path / "t.json").read_text())
    del sidecar["kind"]
    (tmp_path / "t.json").write_text(json.dumps(sidecar))
    assert isinstance(ScalarCodes.load(tmp_path / "t.safetensors")[0], FSQ)


def test_every_code_slot_sees_the_whole_page_unlike_the_per_token_quantizer():
    """Changing one token's features moves codes of other tokens' slots (the compressor attends across
    tokens, so detail can be spent anywhere); the per-token FSQ keeps them."""
    feats = torch.randn(1, 16, 64)
    moved = feats.clone()
    moved[0, 0] += 5
    with torch.no_grad():
        for q, crosses in ((small_cross(), True), (FSQ(64, 16, [16] * 4, hidden=32), False)):
            if not crosses:
                q.init_from_pca(torch.randn(64, 16, 64))
            a, b = q.encode(feats).reshape(16, -1), q.encode(moved).reshape(16, -1)
            assert not torch.equal(a[0], b[0])
            assert (not torch.equal(a[1:], b[1:])) == crosses


@pytest.mark.slow  # trains (8-65 s on the shared box)
def test_the_gradient_passes_the_rounding_and_training_fits():
    q = small_cross()
    data = torch.randn(64, 16, 4) @ torch.randn(4, 64)
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    loss = lambda: (q(data) - data).pow(2).mean() / data.var()
    first = loss()
    first.backward()
    assert q.compress.proj_in.weight.grad.abs().sum() > 0  # straight through the rounding to the compressor
    for _ in range(60):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.5 * first.item()


def test_code_usage_counts_entropy_levels_and_dead_positions():
    q = FSQ(8, 4, [16, 16])  # 4 tokens x 2 dims = 8 code positions
    pages = torch.zeros(32, 4, 2, dtype=torch.uint8)
    pages[:, :, 0] = torch.arange(32)[:, None] % 16  # dim 0: all 16 levels, evenly
    pages[:, :, 1] = 7  # dim 1: one level on every page
    usage = code_usage(pages.flatten(1), q)
    assert usage["dim_entropy_bits"] == [4.0, 0.0] and usage["dim_levels_used"] == [1.0, 0.062]
    assert usage["dead_positions"] == 4 and usage["pages"] == 32


# ----------------------------------------------------------------------------- training, base frozen
def quantizer_args(tmp_path, steps: int, *extra: str) -> list[str]:
    return ["quantizer", "--base", str(NANO), "--width", "32", "--depth", "1", "--heads", "2", "--steps", str(steps),
            "--batch", "2", "--lr", "3e-3", "--warmup", "1", "--cache-pages", "4", "--cache-dir", str(tmp_path / "cache"),
            "--val-pages", "2", "--eval-every", "2", "--save-every", "2", "--eval-pages", "0", "--max-tokens", "16",
            "--manifest", str(tmp_path / "manifest.json"), "--threads", "2", *extra]


@pytest.mark.slow  # trains
def test_quantizer_training_leaves_every_base_tensor_bit_identical(tmp_path):
    weights = NANO / "model-00001-of-000001.safetensors"
    from ocr_latent.checkpoint import file_sha256
    file_before, tensors_before = file_sha256(weights), quantizer_training.base_digest(load_model(NANO))
    out = tmp_path / "q" / "quantizer.safetensors"
    train.main(quantizer_args(tmp_path, 4, "--out", str(out)))
    record = json.loads((tmp_path / "manifest.json").read_text())["artifacts"]["q/quantizer"]
    assert record["base_state_sha256"] == tensors_before and record["base_unchanged"] is True
    assert quantizer_training.base_digest(load_model(NANO)) == tensors_before and file_sha256(weights) == file_before
    assert record["steps"] == 4 and [r["step"] for r in record["val_curve"]] == [2, 4]
    usage = record["code_usage"]
    assert 0 <= usage["dead_positions"] <= 4096 and 0 < usage["dim_entropy_bits_min"] <= 4
    assert record["weights_sha256"] == file_sha256(out) and record["geometry"]["kind"] == "cross_token"


@pytest.mark.slow  # trains
def test_a_base_tensor_that_moves_during_training_stops_the_run_before_anything_is_written(tmp_path, monkeypatch):
    real = quantizer_training.losses

    def touching(model, *args, **kwargs):
        with torch.no_grad():
            model.decoder.lm_head.weight[0, 0] += 1e-3  # what an optimiser over the wrong parameters would do
        return real(model, *args, **kwargs)

    monkeypatch.setattr(quantizer_training, "losses", touching)
    out = tmp_path / "q" / "quantizer.safetensors"
    with pytest.raises(SystemExit, match="base tensor changed"):
        train.main(quantizer_args(tmp_path, 2, "--out", str(out)))
    assert not out.exists() and not (tmp_path / "manifest.json").exists()


@pytest.mark.slow  # trains
def test_a_stopped_run_resumes_to_the_same_quantizer(tmp_path):
    straight, resumed = tmp_path / "a" / "quantizer.safetensors", tmp_path / "b" / "quantizer.safetensors"
    run = lambda steps, out: train.main(quantizer_args(tmp_path, steps, "--out", str(out), "--val-pages", "1"))
    run(6, straight)
    run(4, resumed)  # "stopped" after step 4 (saved at 2, 4)
    run(6, resumed)
    a, b = ScalarCodes.load(straight)[0].state_dict(), ScalarCodes.load(resumed)[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    curve = json.loads((resumed.with_suffix(".run") / "run.json").read_text())["curve"]
    assert [r["step"] for r in curve] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(SystemExit, match="holds a run with"):  # another geometry cannot resume it
        train.main(quantizer_args(tmp_path, 8, "--out", str(resumed), "--width", "64"))


# ----------------------------------------------------------------------------- the original format
def parity_with_tokenizer(tmp_path):
    """The parity checkpoint (original format, random weights, no tokenizer) beside a character-level
    tokenizer that keeps the real model's special-token ids (from the real tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models
    from ocr_latent.training.pages import CHARSET
    parity, real_tc = needs_shared("parity"), needs_shared("deepseek-ocr", "tokenizer_config.json")
    d = tmp_path / "parity-base"
    d.mkdir()
    for f in parity.iterdir():
        if f.name in ("config.json", "model.safetensors.index.json") or f.suffix == ".safetensors" and f.name.startswith("model-"):
            (d / f.name).symlink_to(f)
    shutil.copy(real_tc, d / "tokenizer_config.json")
    specials = {int(k): v["content"] for k, v in json.loads(real_tc.read_text())["added_tokens_decoder"].items()}
    free = (i for i in range(10**6) if i not in specials)
    vocab = {**{c: i for i, c in specials.items()}, **{ch: next(free) for ch in ["\n", *CHARSET]}}
    tok = Tokenizer(models.BPE(vocab={k: v for k, v in vocab.items()}, merges=[], unk_token=None))
    tok.add_special_tokens(list(specials.values()))
    tok.decoder = decoders.Fuse()
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.slow  # starts a server
def test_the_original_format_trains_a_quantizer_then_serves_with_it(tmp_path):
    """`train.py quantizer` on an original-layout checkpoint (the real model's format at small sizes),
    from a directory of page images with transcripts; the server then loads that checkpoint with the
    quantizer it wrote and answers /encode and /decode."""
    base = parity_with_tokenizer(tmp_path)
    pages_dir = tmp_path / "pages"
    pages_dir.mkdir()
    stream = PageStream(split_documents(load_corpus())["train"], PageSpec(min_lines=1, max_lines=1), seed=3)
    for i in range(2):
        stream[i].image.save(pages_dir / f"p{i}.png")
        (pages_dir / f"p{i}.txt").write_text(stream[i].text)
    out = tmp_path / "parity-quantizer" / "quantizer.safetensors"
    tensors_before = quantizer_training.base_digest(load_model(base))
    train.main(["quantizer", "--base", str(base), "--data", str(pages_dir), "--width", "32", "--depth", "1", "--heads", "2",
                "--steps", "2", "--batch", "2", "--out", str(out), "--manifest", str(tmp_path / "manifest.json"),
                "--threads", "2"])
    record = json.loads((tmp_path / "manifest.json").read_text())["artifacts"]["parity-quantizer/quantizer"]
    assert record["base_state_sha256"] == tensors_before and record["geometry"]["embed_dim"] == 64
    assert record["geometry"]["num_codes"] == 4096 and record["base_model"] == "parity-fixture-a"
    srv = Server(tmp_path, "parity", MODEL_DIR=base, QUANTIZER=out, ENCODE_MAX_BATCH=1, DECODE_SLOTS=2)
    try:
        srv.wait_healthy(120)
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            health = c.get("/health").json()
            assert health["model"] == "parity-base" and health["codes_per_image"] == 4096
            png = (pages_dir / "p0.png").read_bytes()
            r = c.post("/encode", content=png, headers={"Content-Type": "image/png"})
            assert r.status_code == 200, r.text
            codes = r.json()["codes"]
            assert len(codes) == 4096 and 0 <= min(codes) and max(codes) <= 15
            r = c.post("/decode", json={"codes_b64": r.json()["codes_b64"], "max_tokens": 8})
            assert r.status_code == 200, r.text
            out = r.json()
            # 8 tokens are too few for the loop detector (>= 48): a read that is not cut off by max_tokens ended at EOS
            assert (out["num_tokens"] == 8 and out["finish_reason"] == "length") or \
                (out["num_tokens"] < 8 and out["finish_reason"] == "stop"), out
            assert len(base64.b64decode(c.post("/encode", content=png, headers={"Content-Type": "image/png"})
                                        .json()["codes_b64"])) == 2048
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- the shipped default
def test_the_default_is_a_full_rank_frozen_base_with_a_cross_token_quantizer_trained_on_it():
    """The embedded default is the honest stand-in for DeepSeek-OCR: its projector has full rank (never
    trained through a bottleneck), and its quantizer crosses tokens and was trained with exactly these
    base tensors frozen (the manifest's digest is the digest of the files that ship)."""
    from ocr_latent.checkpoint import file_sha256
    model = load_model(NANO)
    s = torch.linalg.svdvals(model.encoder.projector.layers.weight.detach().double())
    assert int((s > 1e-3 * s[0]).sum()) == min(model.encoder.projector.layers.weight.shape)
    q, meta = ScalarCodes.load(NANO / "quantizer.safetensors")
    assert isinstance(q, CrossTokenFSQ) and meta["kind"] == "cross_token"
    manifest = json.loads((ROOT / "training_manifest.json").read_text())["artifacts"]
    record = manifest["nano/quantizer"]
    assert record["base_state_sha256"] == quantizer_training.base_digest(model) and record["base_unchanged"]
    assert record["weights_sha256"] == file_sha256(NANO / "quantizer.safetensors")
    assert manifest["nano/base"]["weights_sha256"] == file_sha256(NANO / "model-00001-of-000001.safetensors")
    assert not record["code_commit"].endswith("+uncommitted")
