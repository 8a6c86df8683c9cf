"""train.py quantizer on the embedded nano base, and refusing a quantizer made for another base."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ocr_latent import train
from ocr_latent.checkpoint import CheckpointError, load_model
from conftest import ROOT
from ocr_latent.training.pages import (PageSpec, PageStream, level_pages, load_corpus, split_documents, test_pages,
                                      train_only_documents)
from ocr_latent.serving.pipeline import load_pipeline, load_quantizer
from ocr_latent.quantizer import FSQ

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


@pytest.mark.slow  # trains
def test_a_few_quantizer_steps_lower_the_loss_and_write_a_loadable_quantizer(tmp_path, page_dir):
    out, manifest = tmp_path / "quantizer.safetensors", tmp_path / "manifest.json"
    train.main(["quantizer", "--base", str(NANO), "--data", str(page_dir), "--steps", "8", "--batch", "4",
                "--lr", "3e-3", "--warmup", "1", "--eval-pages", "0", "--out", str(out), "--manifest", str(manifest),
                "--threads", "2"])
    record = json.loads(manifest.read_text())["artifacts"][f"{tmp_path.name}/quantizer"]
    ce = [row["ce"] for row in record["curve"]]
    assert len(ce) == 8 and ce[-1] < ce[0]  # the same 4 pages every step
    assert record["geometry"]["num_codes"] == 4096 and record["base_model"] == load_model(NANO).name
    assert record["data"] == {"dir": str(page_dir), "pages": 4, "draws": 32} and record["hyperparameters"]["steps"] == 8
    fsq, _ = load_quantizer(out, load_model(NANO))  # fingerprint matches the base it was trained on
    assert fsq.num_codes == 4096
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["manifest_sha256"] and sidecar["levels"] == [16] * (4096 // sidecar["tokens"])


@pytest.mark.slow  # trains
def test_per_token_quantizer_on_cached_features_with_mlps(tmp_path):
    """--cache-pages encodes rendered pages once and trains on them; --kind token --hidden adds the
    residual MLPs, recorded in the sidecar so that the server rebuilds the same quantizer; --distill
    pulls the decoder's reading of the codes towards its reading of the uncompressed features."""
    out, manifest, cache = tmp_path / "quantizer.safetensors", tmp_path / "manifest.json", tmp_path / "cache"
    train.main(["quantizer", "--kind", "token", "--base", str(NANO), "--init", "random", "--steps", "12", "--batch", "4",
                "--lr", "3e-3", "--warmup", "1", "--eval-pages", "0", "--val-pages", "0", "--hidden", "32", "--cache-pages", "4",
                "--cache-dir", str(cache), "--decay", "--distill", "1", "--out", str(out),
                "--manifest", str(manifest), "--threads", "2"])
    assert len(json.loads((cache / "features-00000.json").read_text())) == 4  # the texts of the cached pages
    curve = json.loads(manifest.read_text())["artifacts"][f"{tmp_path.name}/quantizer"]["curve"]
    for key in ("ce", "kl"):  # batches are drawn from the same 4 pages
        values = [row[key] for row in curve]
        assert sum(values[-3:]) < sum(values[:3]), (key, values)
    fsq, meta = load_quantizer(out, load_model(NANO))
    assert meta["hidden"] == 32 and fsq.mlp_out[2].weight.abs().sum() > 0
    # a cache is reused only for the pages it holds: another count (or seed, or base) encodes again
    train.main(["quantizer", "--base", str(NANO), "--steps", "1", "--batch", "2", "--eval-pages", "0", "--val-pages", "0",
                "--cache-pages", "3", "--cache-dir", str(cache), "--out", str(tmp_path / "q2.safetensors"),
                "--manifest", str(manifest)])
    assert len(json.loads((cache / "features-00000.json").read_text())) == 3


@pytest.mark.slow  # trains
def test_a_quantizer_for_a_base_of_ordinary_pages_trains_and_reports_on_them_and_on_the_small_pages(tmp_path):
    """--pages KIND: a base trained for other pages gets a quantizer trained on those pages (cached, from the train
    split), validated and tested on held-out pages of the kind, and its test reports v1's small pages beside them,
    since a new default must keep reading those."""
    from ocr_latent.training.pages import PAGE_KINDS, training_documents
    out, manifest, cache = tmp_path / "quantizer.safetensors", tmp_path / "manifest.json", tmp_path / "cache"
    train.main(["quantizer", "--base", str(NANO), "--pages", "level0", "--cache-pages", "3", "--cache-seed", "5",
                "--cache-dir", str(cache), "--steps", "2", "--batch", "2", "--val-pages", "2", "--eval-every", "2",
                "--eval-pages", "2", "--max-tokens", "48", "--out", str(out), "--manifest", str(manifest), "--threads", "1"])
    stream = PageStream(training_documents(), PAGE_KINDS["level0"], seed=5)
    assert json.loads((cache / "features-00000.json").read_text()) == [stream[i].text for i in range(3)]
    record = json.loads(manifest.read_text())["artifacts"][f"{tmp_path.name}/quantizer"]
    assert "of kind level0" in record["data"]["pages"]["train"] and record["hyperparameters"]["pages"] == "level0"
    ordinary, small = record["final_metrics"], record["final_metrics"]["small_pages"]
    assert ordinary["test_pages"] == small["test_pages"] == 2 and len(record["val_curve"]) == 1
    for metrics in (ordinary, small):
        assert 0 <= metrics["cer_uncompressed"] and 0 <= metrics["cer_codes"]
    # v1 reads its own small pages; level 0's pages, long and cut at 48 tokens here, it does not: two sets told apart
    assert small["cer_uncompressed"] < 0.5 < ordinary["cer_uncompressed"]
    with pytest.raises(SystemExit, match="pages"):  # the run is of level-0 pages: resuming it as another kind is refused
        train.main(["quantizer", "--base", str(NANO), "--cache-pages", "3", "--cache-dir", str(cache), "--steps", "3",
                    "--batch", "2", "--out", str(out), "--manifest", str(manifest)])


def test_a_quantizer_for_another_base_is_refused_with_the_fix(tmp_path):
    other = tmp_path / "other-base"
    shutil.copytree(NANO, other)
    model = load_model(other)
    with torch.no_grad():
        model.encoder.projector.layers.weight.mul_(1.5)  # same config, different weights
    from ocr_latent.checkpoint import save_model
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
        settings = [stage["hyperparameters"] for stage in record.get("stages", [])] + [record.get("hyperparameters", {})]
        more_text = any(s.get("more_text") for s in settings)  # pages drawn from the train-only documents too
        assert {s["split"] for s in sources} == {"train", "val", "test"} | ({"train-only"} if more_text else set())
        assert all(len(s["sha256"]) == 64 for s in sources)
        names = {s["name"] for s in sources}
        assert len(names) == len(sources) == len(load_corpus()) + (len(train_only_documents()) if more_text else 0)
    assert manifest["nano/quantizer"]["base_fingerprint"] == json.loads((NANO / "quantizer.json").read_text())["base_fingerprint"]


def test_ship_makes_a_banked_default_the_embedded_one_with_its_records(tmp_path):
    """`train.py ship` puts a banked base and quantizer in place of the default, their records in the manifest (the
    ones they replace kept under 'earlier') with their curves; files their records do not describe, or made by
    uncommitted code, ship nothing."""
    shipped = json.loads((ROOT / "training_manifest.json").read_text())["artifacts"]
    bank = tmp_path / "bank" / "nano"
    shutil.copytree(NANO, bank)
    records = {"nano/base": shipped["nano/base"], "nano/quantizer": shipped["nano/quantizer"]}
    (bank.parent / "manifest.json").write_text(json.dumps({"artifacts": records}))
    curves = [st["curve_file"] for st in records["nano/base"]["stages"]] + [records["nano/quantizer"]["curve_file"]]
    for curve in curves:
        (bank.parent / curve).parent.mkdir(exist_ok=True)
        shutil.copyfile(ROOT / curve, bank.parent / curve)
    to, manifest = tmp_path / "weights" / "nano", tmp_path / "training_manifest.json"
    to.mkdir(parents=True)
    shared = tmp_path / curves[0]  # a curve an earlier record wrote under its own name (a stage the two share)
    shared.parent.mkdir()
    shared.write_text(json.dumps({"name": "an earlier base's stage", "curve": json.loads((ROOT / curves[0]).read_text())["curve"]}))
    kept = shared.read_bytes()
    (to / "model-00002-of-000002.safetensors").write_bytes(b"an older default's shard")
    older = {"kind": "base model trained from scratch", "weights_sha256": "0" * 64}
    manifest.write_text(json.dumps({"artifacts": {"nano/base": older}}))

    def ship(*extra):
        train.main(["ship", str(bank), "--to", str(to), "--manifest", str(manifest), *extra])

    (bank / "quantizer.safetensors").write_bytes((NANO / "quantizer.safetensors").read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match="nothing shipped: .* no record of the quantizer"):
        ship()
    shutil.copyfile(NANO / "quantizer.safetensors", bank / "quantizer.safetensors")
    uncommitted = {**records, "nano/base": {**records["nano/base"], "code_commit": "abc+uncommitted"}}
    (bank.parent / "other.json").write_text(json.dumps({"artifacts": uncommitted}))
    with pytest.raises(SystemExit, match="base was made by uncommitted code"):
        ship("--bank-manifest", str(bank.parent / "other.json"))
    assert sorted(p.name for p in to.iterdir()) == ["model-00002-of-000002.safetensors"]  # nothing moved yet

    ship()
    assert sorted(p.name for p in to.iterdir()) == sorted(train.DEFAULT_FILES)
    assert all((to / name).read_bytes() == (NANO / name).read_bytes() for name in train.DEFAULT_FILES)
    after = json.loads(manifest.read_text())
    assert after["artifacts"]["nano/base"]["weights_sha256"] == shipped["nano/base"]["weights_sha256"]
    assert after["artifacts"]["nano/quantizer"]["shipped_as"] == str(to)
    assert after["earlier"]["0" * 64]["artifact"] == "nano/base"
    assert all((tmp_path / curve).read_bytes() == (ROOT / curve).read_bytes() for curve in curves[1:])
    assert shared.read_bytes() == kept
    fsq, _ = load_quantizer(to / "quantizer.safetensors", load_model(to))  # the shipped pair loads as a pair
    assert fsq.geometry() == records["nano/quantizer"]["geometry"]


@pytest.mark.slow  # trains
def test_staged_base_training_trains_only_its_part_and_resumes(tmp_path, capsys):
    """`base --stage encoder` moves the towers and projector only; `--stage decoder` (cached features)
    moves the decoder only; a second call with more steps resumes where the first stopped."""
    def params(model):
        return ({k: v.clone() for k, v in model.encoder.state_dict().items()},
                {k: v.clone() for k, v in model.decoder.state_dict().items()})

    def changed(before, after):
        return any(not torch.equal(before[k], after[k]) for k in before)

    enc_run, dec_run = tmp_path / "enc", tmp_path / "dec"
    common = ["--batch", "2", "--val-pages", "2", "--eval-every", "1000", "--threads", "2", "--save-every", "1",
              "--max-tokens", "16"]
    nano_enc, nano_dec = params(load_model(NANO))
    train.main(["base", "--stage", "encoder", "--init", str(NANO), "--out", str(enc_run), "--steps", "2",
                "--order-weight", "1", *common])
    enc, dec = params(load_model(enc_run))
    assert changed(nano_enc, enc) and not changed(nano_dec, dec)
    meta = json.loads((enc_run / "train_meta.json").read_text())
    assert meta["step"] == 2 and "val_slot_acc" in meta["curve"][-1]

    # resumed with the patch loss added: its head (and only its head) starts without optimiser state
    train.main(["base", "--stage", "encoder", "--out", str(enc_run), "--steps", "3", "--order-weight", "1",
                "--patch-weight", "1", *common])
    meta = json.loads((enc_run / "train_meta.json").read_text())
    assert meta["step"] == 3 and 0.0 <= meta["curve"][-1]["val_patch_acc"] <= 1.0 and meta["curve"][-1]["patch_loss"] > 0

    # the towers' reading by glyph size (bench/tower_accuracy.py) with the run's heads: every character of
    # the pages is one occupied slot of each head, so both heads count the same slots
    from bench.tower_accuracy import main as tower_accuracy
    tower_accuracy([str(enc_run), "--level", "small", "--pages", "2", "--split-at", "60", "--edge-slack", "16"])
    accuracy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"]
    pages = level_pages(split_documents(load_corpus())["val"], "small", 2, 21)
    assert accuracy["patch, under 60 px"]["slots"] == accuracy["token, under 60 px"]["slots"] == sum(
        1 for p in pages for box in p.char_boxes if box[0] != " ")
    # lines near a row's edge counted on the side read better: the same glyphs, read no worse
    either = accuracy["token either side, under 60 px"]
    assert either["slots"] == accuracy["token, under 60 px"]["slots"]
    assert either["accuracy"] >= accuracy["token, under 60 px"]["accuracy"]
    assert all(0 <= row["accuracy"] <= 1 for row in accuracy.values())
    # and by how far down its token's square a glyph's centre lies: each glyph once
    bands = {key: row["slots"] for key, row in accuracy.items() if key.startswith("token, centre ")}
    assert 1 <= len(bands) <= 4
    by_size = sum(accuracy[f"token, {size}"]["slots"] for size in ("under 60 px", "60 px and over") if f"token, {size}" in accuracy)
    assert sum(bands.values()) == by_size
    # and by how many text lines its token holds
    held = {key: row["slots"] for key, row in accuracy.items() if key.endswith(" in its token")}
    assert 1 <= len(held) <= 3 and sum(held.values()) == by_size

    # a widened run (--widen-from) starts from the run's towers at twice SAM's width, with its heads
    wide_run = tmp_path / "wide"
    train.main(["base", "--stage", "encoder", "--widen-from", str(enc_run), "--widen", "sam,clip", "--out", str(wide_run), "--steps", "1",
                "--order-weight", "1", "--patch-weight", "1", "--field-targets", "--line-targets", "--slot-lines", "2", "--two-line-weight", "3", *common])
    wide = load_model(wide_run)
    narrow = load_model(enc_run).encoder.cfg
    assert (wide.encoder.cfg.sam_neck_channels, wide.encoder.cfg.clip_width) == (2 * narrow.sam_neck_channels, 2 * narrow.clip_width)
    assert json.loads((wide_run / "train_meta.json").read_text())["widened_from"] == str(enc_run)

    train.main(["base", "--stage", "decoder", "--init", str(enc_run), "--out", str(dec_run), "--steps", "2",
                "--cache-pages", "4", "--token-dropout", "0.1", "--keep-best", *common])
    enc2, dec2 = params(load_model(dec_run))
    assert not changed(params(load_model(enc_run))[0], enc2) and changed(dec, dec2)
    meta = json.loads((dec_run / "train_meta.json").read_text())
    assert meta["step"] == 2 and "val_cer" in meta["curve"][-1] and (dec_run / "features" / "features-00000.safetensors").exists()
    # the best reader so far (--keep-best): the only one measured, at the last step
    assert meta["best"] == {"step": 2, "val_cer": meta["curve"][-1]["val_cer"]}
    assert not changed(dec2, params(load_model(dec_run / "best"))[1])

    # a fresh head on the decoder stage's cached tokens (bench/token_probe.py): it reads the held-out cache page and
    # the held-out documents' pages through the run's towers, every glyph once, by the lines its token holds
    from bench.token_probe import main as token_probe
    token_probe([str(dec_run), "--held-out", "1", "--steps", "3", "--batch", "64", "--level", "small", "--pages", "2",
                 "--slot-lines", "2", "--two-line-weight", "3", "--field-targets", "--line-targets"])
    probed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert probed["trained_on"] == 3
    val = probed["accuracy"]["level small, held-out documents"]
    assert sum(row["slots"] for row in val.values()) == sum(1 for p in pages for box in p.char_boxes if box[0] != " ")
    assert set(val) <= {"1 text line", "2 text lines", "3+ text lines"} and all(0 <= r["accuracy"] <= 1 for r in val.values())
    assert sum(row["slots"] for row in probed["accuracy"]["held-out cache pages"].values()) > 0
    # a cache of other towers is refused, and so is a run without one
    shutil.copytree(dec_run / "features", wide_run / "features")
    with pytest.raises(SystemExit, match="cached from other towers"):
        token_probe([str(wide_run), "--held-out", "1", "--steps", "1"])
    with pytest.raises(SystemExit, match="no feature cache"):
        token_probe([str(enc_run), "--steps", "1"])

    # towers from one run, the decoder from another (--decoder-from): the wide towers with the decoder stage's
    # decoder (a learning rate of 0 keeps both as they came)
    spliced = tmp_path / "spliced"
    train.main(["base", "--stage", "decoder", "--init", str(wide_run), "--decoder-from", str(dec_run), "--out", str(spliced),
                "--steps", "1", "--cache-pages", "4", "--lr", "0", *common])
    assert not changed(params(wide)[0], params(load_model(spliced))[0])
    assert not changed(dec2, params(load_model(spliced))[1]) and changed(dec, dec2)

    # the export serves the last stage's weights and its manifest record names every stage, back through
    # the widening to the first, and the stage its decoder came from
    manifest, exported = tmp_path / "manifest.json", tmp_path / "nano"
    train.main(["export", "--run", str(spliced), "--to", str(exported), "--test-pages", "2", "--manifest", str(manifest)])
    assert not changed(params(load_model(spliced))[1], params(load_model(exported))[1])
    record = json.loads(manifest.read_text())["artifacts"]["nano/base"]
    assert [(s["run"], s["stage"], s["steps"]) for s in record["stages"]] == [
        (str(enc_run), "encoder", 3), (str(wide_run), "encoder", 1), (str(dec_run), "decoder", 2), (str(spliced), "decoder", 1)]
    assert record["stages"][-1]["hyperparameters"]["decoder_from"] == str(dec_run)
    assert record["steps"] == 7 and record["test_metrics_uncompressed"]["pages"] == 2
    # --dtype bf16: half the bytes, the file saying so, and the weights the run's rounded to bf16, read back at fp32
    half, shard = tmp_path / "nano-bf16", "model-00001-of-000001.safetensors"
    train.main(["export", "--run", str(spliced), "--to", str(half), "--dtype", "bf16", "--test-pages", "1", "--manifest", str(manifest)])
    assert (half / shard).stat().st_size < 0.6 * (exported / shard).stat().st_size
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = {k: v.to(torch.bfloat16).float() for k, v in params(load_model(exported))[1].items()}
    assert not changed(rounded, params(load_model(half))[1])


@pytest.mark.slow  # trains
def test_bottleneck_stages_fold_into_the_projector_and_start_a_quantizer(tmp_path):
    """`--bottleneck` learns a linear FSQ with the towers (their dense-loss heads read its codes) or
    with the decoder, and carries over from one stage to the next; the export folds its projection
    into the projector (original layout, rank = code dims per token), and that FSQ gives the exported
    base the same codes as the run's features, so a quantizer can start from it (--init PATH)."""
    enc, run, exported = tmp_path / "enc", tmp_path / "bn", tmp_path / "nano"
    common = ["--steps", "2", "--batch", "2", "--val-pages", "2", "--eval-every", "2", "--threads", "2", "--bottleneck",
              "--max-tokens", "16"]
    train.main(["base", "--stage", "encoder", "--init", str(NANO), "--out", str(enc), "--order-weight", "1",
                "--head-hidden", "8", *common])
    assert "val_slot_acc" in json.loads((enc / "train_meta.json").read_text())["curve"][-1]
    enc_state = load_file(str(enc / "train_state.safetensors"))
    assert "aux.0.weight" in enc_state and "order.2.weight" in enc_state  # hidden-layer heads
    train.main(["base", "--stage", "decoder", "--init", str(enc), "--out", str(run), "--cache-pages", "4", "--lr", "0", *common])
    assert "val_cer_codes" in json.loads((run / "train_meta.json").read_text())["curve"][-1]
    carried = load_file(str(run / "train_state.safetensors"))
    torch.testing.assert_close(carried["bottleneck.proj_out.weight"], enc_state["bottleneck.proj_out.weight"])
    train.main(["export", "--run", str(run), "--to", str(exported), "--test-pages", "2", "--manifest", str(tmp_path / "m.json")])
    fsq, _ = FSQ.load(run / "bottleneck.safetensors")
    unfolded, folded = load_model(run), load_model(exported)
    assert torch.linalg.matrix_rank(folded.encoder.projector.layers.weight) == fsq.dims == 16
    page = test_pages(seed=5)[0]
    with torch.inference_mode():
        before, after = (m.encoder.encode_images([page.image], "base") for m in (unfolded, folded))
        assert torch.equal(fsq.encode(before), fsq.encode(after))
        assert not torch.allclose(before, after)  # the fold did change the base
    out = tmp_path / "q.safetensors"
    train.main(["quantizer", "--kind", "token", "--base", str(exported), "--init", str(run / "bottleneck.safetensors"),
                "--hidden", "8", "--steps", "1", "--batch", "2", "--lr", "0", "--cache-pages", "2", "--eval-pages", "0",
                "--val-pages", "0", "--out", str(out),
                "--manifest", str(tmp_path / "m.json")])
    started, _ = load_quantizer(out, folded)
    torch.testing.assert_close(started.proj_out.weight, fsq.proj_out.weight)


def test_a_feature_cache_of_more_text_is_drawn_from_the_train_only_documents_and_kept_apart(tmp_path):
    """--more-text: cached training pages take their text from corpus/train-only too, and a cache made
    with them is never read as one of the training split alone (nor the other way round)."""
    from ocr_latent.training import features
    from ocr_latent.training.pages import train_only_documents
    model, out = load_model(NANO), tmp_path / "features"
    source = lambda text, docs: any("".join(text.split()) in "".join(d.text.split()) for d in docs)  # lines wrap anew
    train_docs, extra = split_documents(load_corpus())["train"], train_only_documents()
    _, more = features.load(model, 6, 3, out, more_text=True)
    assert any(source(t, extra) for t in more) and all(source(t, train_docs + extra) for t in more)
    _, plain = features.load(model, 6, 3, out)  # rebuilt: the shard was made of more documents
    assert plain != more and all(source(t, train_docs) for t in plain)
    assert features.load(model, 6, 3, out, more_text=True)[1] == more


@pytest.mark.slow  # trains, with pages rendered in worker processes
def test_pages_rendered_in_worker_processes_train_and_cache_what_one_thread_renders(tmp_path):
    """--workers N (for a GPU, whose steps outrun one CPU's rendering): the training pages and a feature cache's
    pages are rendered in N processes, ahead of their use; the run and the cache are the ones the one rendering
    thread gives, bit for bit, nothing lost or reordered, even where that run was stopped by --stop-after-s (a
    lent machine's time), saved, and resumed."""
    from ocr_latent.training import features
    common = ["base", "--stage", "encoder", "--init", str(NANO), "--steps", "2", "--batch", "2", "--val-pages", "1",
              "--eval-every", "1000", "--save-every", "1000", "--threads", "2", "--order-weight", "1"]
    train.main([*common, "--out", str(tmp_path / "run0"), "--stop-after-s", "0.001"])
    meta = json.loads((tmp_path / "run0" / "train_meta.json").read_text())
    assert meta["step"] == 1 and "val_slot_acc" in meta["curve"][-1]
    train.main([*common, "--out", str(tmp_path / "run0")])
    train.main([*common, "--out", str(tmp_path / "run2"), "--workers", "2"])
    runs = [load_file(str(tmp_path / f"run{w}" / name)) for w in (0, 2)
            for name in ("train_state.safetensors", "model-00001-of-000001.safetensors")]
    assert all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0]) and all(torch.equal(runs[1][k], runs[3][k]) for k in runs[1])
    assert not all(torch.equal(runs[1][k], v) for k, v in load_file(str(NANO / "model-00001-of-000001.safetensors")).items())

    model = load_model(NANO)
    for workers in (0, 2):
        features.build(model, 3, 3, tmp_path / f"cache{workers}", batch=2, workers=workers)
    (one, one_texts), (two, two_texts) = (features.load(model, 3, 3, tmp_path / f"cache{w}") for w in (0, 2))
    assert torch.equal(one, two) and one_texts == two_texts and len(set(one_texts)) == 3
    pages = PageStream(split_documents(load_corpus())["train"], PageSpec(), seed=3)
    assert one_texts == [pages[i].text for i in range(3)]


def test_heads_asked_of_an_exported_model_are_refused_with_the_reason(tmp_path):
    with pytest.raises(SystemExit, match="holds no train_state.safetensors .* an exported model has no heads"):
        train.main(["base", "--stage", "encoder", "--init", str(NANO), "--heads-from", str(NANO), "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_training_on_a_gpu_this_torch_cannot_see_says_so(tmp_path):
    with pytest.raises(SystemExit, match="sees no CUDA GPU; train with --device cpu"):
        train.main(["base", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="sees no CUDA GPU; train with --device cpu"):
        train.main(["quantizer", "--base", str(NANO), "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "q.safetensors")])
    with pytest.raises(SystemExit, match="--device tpu: give cpu, cuda or cuda:N"):
        train.main(["quantizer", "--base", str(NANO), "--device", "tpu", "--steps", "1", "--out", str(tmp_path / "q.safetensors")])
    assert not list(tmp_path.iterdir())


def test_length_grouped_batches_draw_every_page_once_an_epoch_with_little_padding():
    import random
    lengths = [random.Random(i).randint(50, 1500) for i in range(1000)]
    epoch = [train.length_grouped_batch(lengths, 8, step, 3, 16) for step in range(125)]
    assert sorted(i for b in epoch for i in b) == list(range(1000))
    assert epoch == [train.length_grouped_batch(lengths, 8, step, 3, 16) for step in range(125)]  # resumable
    padded = lambda batches: sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths)
    ungrouped = [train.length_grouped_batch(lengths, 8, step, 3, 1) for step in range(125)]
    assert padded(epoch) < 1.1 < 1.5 < padded(ungrouped)
    assert train.length_grouped_batch(lengths, 8, 125, 3, 16) != epoch[0]  # the next epoch, another order


def test_a_grown_nano_reads_as_the_v1_it_grew_from_and_spells_latin1(nano_v1):
    """nano v3 starts as v1 (new blocks are the identity, v1's tokens keep their ids), with more depth
    to learn ordinary pages and a tokenizer that spells the Latin-1 letters."""
    from ocr_latent.training.losses import teacher_forced_logits
    from ocr_latent.training.nano import grown_nano
    from ocr_latent.training.pages import test_pages
    v1 = load_model(nano_v1)
    grown = grown_nano(v1, seed=0)
    assert len(grown.encoder.sam_model.blocks) == 2 * len(v1.encoder.sam_model.blocks)
    assert len(grown.decoder.layers) == len(v1.decoder.layers) + 1
    assert grown.tokenizer.encode("Müller é ß").ids[:1] == v1.tokenizer.encode("M").ids
    assert len(grown.tokenizer.encode("éüß", add_special_tokens=False).ids) == 3
    page = test_pages(1, seed=2)[0]
    with torch.no_grad():
        read = [teacher_forced_logits(m, [m.decoder.layout_image(f) for f in m.encoder.encode_images([page.image], "base")],
                                      [page.text]) for m in (v1, grown)]
    (old_logits, target), (new_logits, _) = read
    scored = target != -100
    assert torch.allclose(new_logits[..., :old_logits.shape[-1]], old_logits, atol=1e-5)
    assert (old_logits.argmax(-1) == target)[scored].float().mean() > 0.8  # v1 reads the page: the test can fail


@pytest.mark.parametrize("towers", [("sam",), ("sam", "clip"), ("clip",)])
def test_a_widened_nano_computes_what_it_was_widened_from_with_copies_free_to_learn_apart(towers, nano_v1):
    """A widened nano (v4 is v3 widened) doubles SAM's channels of a trained model (glyphs of ordinary
    text are one or two patches): it starts reading exactly as the narrow one did, a patch head split over
    the neck's copies reads the same, and the copies are read with different weights, so training can
    make them differ."""
    from ocr_latent.training.nano import split_inputs, widened_nano
    from ocr_latent.training.pages import test_pages
    v3 = load_model(nano_v1)
    v4 = widened_nano(v3, seed=1, towers=towers)
    twice = lambda name: getattr(v4.encoder.cfg, name) == 2 * getattr(v3.encoder.cfg, name)
    assert all(twice(name) == ("sam" in towers) for name in ("sam_width", "sam_heads", "sam_neck_channels"))
    assert all(twice(name) == ("clip" in towers) for name in ("clip_width", "clip_heads", "projector_input_dim"))
    page = test_pages(1, seed=2)[0]
    necks = []
    for m in (v3, v4):
        m.encoder.sam_model.neck.register_forward_hook(lambda module, inputs, out: necks.append(out))
    old, new = (m.encoder.encode_images([page.image], "base") for m in (v3, v4))
    assert old.abs().max() > 1 and torch.allclose(new, old, atol=1e-3 * old.abs().max())
    head = torch.nn.Linear(necks[0].shape[1], 10)
    wide_head = torch.nn.Linear(necks[1].shape[1], 10)
    split = split_inputs if "sam" in towers else lambda weight, gen: weight  # over the neck's copies, if any
    wide_head.load_state_dict({"weight": split(head.weight.detach(), torch.Generator().manual_seed(0)),
                               "bias": head.bias.detach()})
    with torch.no_grad():
        read = [h(n.flatten(2).transpose(1, 2)) for h, n in ((head, necks[0]), (wide_head, necks[1]))]
    assert torch.allclose(read[1], read[0], atol=1e-4)
    assert not torch.allclose(read[0], torch.zeros_like(read[0]), atol=1e-2)
    for tower in towers:  # the copies' readers differ
        qkv = (v4.encoder.sam_model.blocks[0].attn.qkv if tower == "sam" else v4.encoder.vision_model.transformer.layers[0].self_attn.qkv_proj).weight
        half = qkv.shape[1] // 2
        assert not torch.allclose(qkv[:, :half], qkv[:, half:])


@pytest.mark.slow  # trains
def test_the_joint_curriculum_goes_up_a_level_only_when_the_level_reads(tmp_path):
    """`--advance-at CER`: a level is passed when its validation pages read under that CER, not after a
    number of steps; the level and the step it was reached are kept with the run, so a resumed run goes on
    at its level."""
    run = tmp_path / "joint"
    common = ["base", "--stage", "joint", "--grow-from", str(NANO), "--pages", "nano2", "--out", str(run), "--batch", "1",
              "--eval-every", "1", "--level-val-pages", "1", "--val-pages", "1", "--max-tokens", "8", "--threads", "2",
              "--save-every", "1", "--order-weight", "1", "--order-slots", "4"]
    train.main([*common, "--steps", "2", "--advance-at", "100"])  # any reading passes: a level at every evaluation
    meta = json.loads((run / "train_meta.json").read_text())
    assert meta["level"] == 2 and meta["levels_reached"] == [{"level": 1, "step": 1}, {"level": 2, "step": 2}]
    assert [row["level"] for row in meta["curve"] if "level" in row] == [0, 1]
    assert all(0 <= row["val_small_cer"] and 0 <= row["val_level_cer"] for row in meta["curve"] if "level" in row)
    train.main([*common, "--steps", "3", "--advance-at", "1e-9"])  # no reading passes: it stays where it was
    meta = json.loads((run / "train_meta.json").read_text())
    assert meta["step"] == 3 and meta["level"] == 2 and meta["curve"][-1]["level"] == 2
    # a new run from it (--init) starts its dense-loss heads from the run's trained ones (--heads-from)
    fresh = tmp_path / "fresh"
    flags = ["base", "--stage", "joint", "--init", str(run), "--pages", "nano2", "--out", str(fresh), *common[9:],
             "--steps", "1", "--lr", "0"]
    train.main([*flags, "--heads-from", str(run)])
    heads = lambda path: {k: v for k, v in load_file(str(path / "train_state.safetensors")).items() if k.startswith(("aux.", "order."))}
    assert heads(fresh).keys() == heads(run).keys() and all(torch.equal(v, heads(run)[k]) for k, v in heads(fresh).items())


def test_each_character_of_a_page_is_placed_in_the_token_its_box_lies_in():
    from ocr_latent.training.losses import char_cells
    from ocr_latent.training.pages import FIELD_SHIFT, on_lines, token_cell
    page = level_pages(split_documents(load_corpus())["val"], 0, 1)[0]
    for view, shift in ((page, 0.0), (on_lines(page), FIELD_SHIFT)):
        cells = char_cells(view, 16, shift)
        assert len(cells) == len(page.text)
        glyphs = [c for ch, c in zip(page.text, cells) if ch not in " \n"]
        assert glyphs == [token_cell(view, box, 16, shift) for box in view.char_boxes]
        assert all(c == -1 for ch, c in zip(page.text, cells) if ch in " \n") and all(0 <= c < 256 for c in glyphs)
    assert char_cells(on_lines(page), 16, FIELD_SHIFT) != char_cells(page, 16)  # the placement is the run's choice


def test_a_line_pointer_looks_at_the_token_only_for_the_second_of_two_lines_sharing_it():
    from PIL import Image

    from ocr_latent.training.losses import AT_BOS, Pointer, char_cells, pointer_targets
    from ocr_latent.training.pages import Page
    # 64 px token rows: "ab" (middle 46 px down) and "cd" (98 px) share row 1 with the field shift, "ef" has row 3
    boxes = [(ch, x, y - 10, x + 20, y + 10) for ch, x, y in
             (("a", 10, 46), ("b", 40, 46), ("c", 10, 98), ("d", 40, 98), ("e", 10, 200), ("f", 40, 200))]
    page = Page(image=Image.new("RGB", (1024, 1024)), text="ab\ncd\nef", lines=["ab", "cd", "ef"], char_boxes=boxes,
                font="DejaVuSans", font_size=20, source="x")
    every = char_cells(page, 16, 0.375)
    assert every == [16, 17, -1, 16, 17, -1, 48, 49]
    assert char_cells(page, 16, 0.375, second_lines=True) == [AT_BOS, AT_BOS, -1, 16, 17, -1, AT_BOS, AT_BOS]
    # the positions predicting each character (targets: 3 prompt positions, the text, EOS) and what they point at
    target = torch.tensor([[-100] * 3 + list(range(9))])
    queries, keys = pointer_targets(Pointer([], [char_cells(page, 16, 0.375, second_lines=True)], 16), target, 0)
    assert queries.tolist() == [3, 4, 6, 7, 9, 10] and keys.tolist() == [0, 0, 18, 19, 0, 0]  # tokens 16, 17: row 1, after BOS
    # a tokenizer that drops a character (one outside its charset) leaves no position to point from: said, not guessed
    with pytest.raises(ValueError, match="one text token per character"):
        pointer_targets(Pointer([], [every], 16), target[:, :-1], 0)


def test_the_pointer_loss_reads_the_attention_the_decoder_computes():
    """AttentionTap's attention of a head, times that head's values, is what the layer hands its output projection;
    each guided position's key is the vision token showing the character it predicts."""
    from ocr_latent.training.losses import AttentionTap, Pointer, char_cells, pointer_accuracy, pointer_loss, pointer_targets, \
        teacher_forced_logits
    model = load_model(NANO)
    stream = PageStream(split_documents(load_corpus())["train"], PageSpec(), seed=7)
    pages = [stream[i] for i in range(2)]
    kept = {}
    attn = model.decoder.layers[2].self_attn
    hooks = [attn.v_proj.register_forward_hook(lambda m, i, out: kept.__setitem__("v", out)),
             attn.o_proj.register_forward_hook(lambda m, i, out: kept.__setitem__("heads", i[0]))]
    pointer = Pointer([(1, 0), (2, 3)], [char_cells(p, 16) for p in pages], 16)
    with torch.no_grad(), AttentionTap(model.decoder, {1, 2}) as tap:
        feats = model.encoder.encode_images([p.image for p in pages], "base")
        _, target = teacher_forced_logits(model, [model.decoder.layout_image(f) for f in feats], [p.text for p in pages])
        loss, accuracy = pointer_loss(tap, pointer, target), pointer_accuracy(tap, pointer, target)
    for hook in hooks:
        hook.remove()
    d = model.decoder.cfg.head_dim
    queries, keys = pointer_targets(pointer, target, 1)
    attention = tap.log_attention(2, 3, 1, queries).exp()
    torch.testing.assert_close(attention @ kept["v"][1, :, 3 * d:4 * d], kept["heads"][1, queries, 3 * d:4 * d])
    # one query for each character a token shows, at the position that predicts it; keys are image positions
    text = pages[1].text
    assert len(queries) == sum(1 for ch in text if ch not in " \n") and int(target[1, queries[0]]) == model.tokenizer.encode(
        text[0], add_special_tokens=False).ids[0]
    assert ((keys >= 1) & (keys < 1 + 16 * 17)).all() and not ((keys % 17) == 0).any()  # never a row's newline
    # v1 learned a pointer of its own in its last layer (head 3), none in layer 1
    assert 0 < loss.item() and 0.3 < accuracy < 0.5


@pytest.mark.slow  # trains
def test_a_decoder_stage_with_the_pointer_loss_teaches_its_heads_where_to_look(tmp_path, nano_v1):
    """Guided heads that start looking elsewhere (v1's head 0 of layers 1 and 2 point at the right token for
    under 1 % of the characters) learn to look at the token showing the character they predict."""
    run = tmp_path / "dec"
    train.main(["base", "--stage", "decoder", "--init", str(nano_v1), "--out", str(run), "--steps", "8", "--batch", "4",
                "--cache-pages", "4", "--val-pages", "2", "--eval-every", "4", "--threads", "2", "--save-every", "4",
                "--lr", "3e-3", "--warmup", "1", "--pointer-weight", "1", "--pointer-heads", "1:0,2:0",
                "--line-pointer-heads", "2:1", "--max-tokens", "16"])
    curve = [row for row in json.loads((run / "train_meta.json").read_text())["curve"] if "pointer_loss" in row]
    assert [row["step"] for row in curve] == [4, 8] and 0 <= curve[1]["val_line_pointer_acc"] <= 1
    assert curve[1]["pointer_loss"] < 0.7 * curve[0]["pointer_loss"]  # the same 4 pages every step
    assert 0.05 < curve[1]["val_pointer_acc"] <= 1  # and on held-out pages
    cells = json.loads((run / "features" / "cells.json").read_text())
    assert len(cells["cells"]) == 4 and cells["placement"].startswith("grid 16, shift 0.0")
    assert set(cells["cells"][0]) == {"every", "second_lines"}
    with pytest.raises(SystemExit, match="layer:head pairs"):
        train.main(["base", "--stage", "decoder", "--init", str(nano_v1), "--out", str(tmp_path / "bad"), "--steps", "1",
                    "--cache-pages", "4", "--pointer-weight", "1", "--pointer-heads", "3:0"])
