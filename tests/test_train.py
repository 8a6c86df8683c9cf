"""train.py quantizer on the embedded nano base, and refusing a quantizer made for another base."""
import json
import shutil

import pytest
import torch

import train
from checkpoint import CheckpointError, load_model
from conftest import ROOT
from pages import PageSpec, PageStream, load_corpus, split_documents
from pipeline import load_pipeline, load_quantizer
from quantizer import FSQ

NANO = ROOT / "weights" / "nano"


@pytest.fixture(scope="module")
def page_dir(tmp_path_factory):
    """Four rendered training pages as IMAGE + .txt pairs: the --data DIR format for real checkpoints."""
    d = tmp_path_factory.mktemp("pages")
    stream = PageStream(split_documents(load_corpus())["train"], PageSpec(), seed=7)
    for i in range(4):
        page = stream[i]
        page.image.save(d / f"p{i}.png")
        (d / f"p{i}.txt").write_text(page.text)
    return d


def test_a_few_quantizer_steps_lower_the_loss_and_write_a_loadable_quantizer(tmp_path, page_dir):
    out, manifest = tmp_path / "quantizer.safetensors", tmp_path / "manifest.json"
    train.main(["quantizer", "--base", str(NANO), "--data", str(page_dir), "--steps", "8", "--batch", "4",
                "--lr", "3e-3", "--eval-pages", "0", "--out", str(out), "--manifest", str(manifest), "--threads", "2"])
    record = json.loads(manifest.read_text())["artifacts"][f"{tmp_path.name}/quantizer"]
    ce = [row["ce"] for row in record["curve"]]
    assert len(ce) == 8 and ce[-1] < ce[0]  # the same 4 pages every step
    assert record["geometry"]["num_codes"] == 4096 and record["base_model"] == "ocr-latent/nano"
    assert record["data"] == {"dir": str(page_dir)} and record["hyperparameters"]["steps"] == 8
    fsq, _ = load_quantizer(out, load_model(NANO))  # fingerprint matches the base it was trained on
    assert fsq.num_codes == 4096
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["manifest_sha256"] and sidecar["levels"] == [16] * (4096 // sidecar["tokens"])


def test_a_quantizer_for_another_base_is_refused_with_the_fix(tmp_path):
    other = tmp_path / "other-base"
    shutil.copytree(NANO, other)
    model = load_model(other)
    with torch.no_grad():
        model.encoder.projector.layers.weight.mul_(1.5)  # same config, different weights
    from checkpoint import save_model
    save_model(model, other)
    with pytest.raises(CheckpointError, match="not for the loaded base .* train a quantizer for this base"):
        load_pipeline(str(other), quantizer=str(NANO / "quantizer.safetensors"))
    (other / "quantizer.safetensors").unlink()
    (other / "quantizer.json").unlink()
    with pytest.raises(CheckpointError, match="not found: train one with"):
        load_quantizer(other / "quantizer.safetensors", model)


def test_manifest_records_every_source_with_hash_and_split():
    manifest = json.loads((ROOT / "training_manifest.json").read_text())["artifacts"]
    for name in ("nano/base", "nano/quantizer"):
        record = manifest[name]
        sources = record["data"]["sources"]
        assert {s["split"] for s in sources} == {"train", "val", "test"}
        assert all(len(s["sha256"]) == 64 for s in sources)
        names = {s["name"] for s in sources}
        assert len(names) == len(sources) == len(load_corpus())
    assert manifest["nano/quantizer"]["base_fingerprint"] == json.loads((NANO / "quantizer.json").read_text())["base_fingerprint"]
