"""Training and measuring a quantizer without transcripts: the base's own reading is the target."""
import json

import pytest
import torch

from conftest import ROOT
from ocr_latent import train
from ocr_latent.checkpoint import load_model
from ocr_latent.serving.pipeline import load_quantizer
from ocr_latent.training import self_reading
from ocr_latent.training.evaluation import read_pages
from ocr_latent.training.pages import test_pages

NANO = ROOT / "weights" / "nano"


@pytest.fixture(scope="module")
def scans(tmp_path_factory):
    """What a user has: two page images (one with a transcript beside it) and a 2-page PDF."""
    d = tmp_path_factory.mktemp("scans")
    pages = list(test_pages(4, seed=11))
    pages[0].image.save(d / "a.png")
    (d / "a.txt").write_text(pages[0].text)
    (d / "sub").mkdir()
    pages[1].image.convert("L").save(d / "sub" / "b.jpg", quality=90)
    pages[2].image.save(d / "sub" / "doc.pdf", save_all=True, append_images=[pages[3].image], resolution=72)
    (d / "notes.md").write_text("not a page")
    return d


def test_a_directory_of_images_and_pdfs_lists_every_page(scans):
    names = [name for name, _ in self_reading.directory_pages(scans, "base")]
    assert names == ["a.png", "sub/b.jpg", "sub/doc.pdf#1", "sub/doc.pdf#2"]
    image = dict(self_reading.directory_pages(scans, "base"))["sub/doc.pdf#2"]()
    assert max(image.size) == 1024  # a PDF page is rendered at the view size, as /encode renders it


@pytest.mark.slow  # trains
def test_self_targets_are_the_uncompressed_reading_and_a_few_steps_lower_the_loss(tmp_path, scans):
    out, manifest = tmp_path / "quantizer.safetensors", tmp_path / "manifest.json"
    train.main(["quantizer", "--targets", "self", "--base", str(NANO), "--data", str(scans), "--steps", "8",
                "--batch", "4", "--lr", "3e-3", "--warmup", "1", "--val-pages", "0", "--eval-pages", "0",
                "--out", str(out), "--manifest", str(manifest), "--threads", "2", "--target-max-tokens", "96"])
    record = json.loads(manifest.read_text())["artifacts"][f"{tmp_path.name}/quantizer"]
    assert record["data"]["pages"] == 4 and record["data"]["files"] == 3
    assert "own greedy uncompressed reading" in record["data"]["targets"]
    ce = [row["ce"] for row in record["curve"]]
    assert len(ce) == 8 and ce[-1] < ce[0]

    # the cached targets are what the frozen base reads from the uncompressed features of those pages
    model = load_model(NANO)
    cache = out.with_suffix(".run") / "pages"
    targets = json.loads((cache / "own-reading.json").read_text())["texts"]
    feats, names = self_reading.encode_directory(model, scans, "base", cache)
    assert len(targets) == 4 and all(targets)
    first = model.encoder.encode_images([self_reading.directory_pages(scans, "base")[0][1]()], "base")
    assert read_pages(model, [model.decoder.layout_image(first[0])], 96) == [targets[0]]
    load_quantizer(out, model)  # made for this base


@pytest.mark.slow  # trains
def test_report_compares_the_codes_reading_with_the_uncompressed_one(tmp_path, scans, capsys):
    train.main(["report", "--data", str(scans), "--base", str(NANO), "--cache-dir", str(tmp_path / "cache"),
                "--max-tokens", "200"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["pages"] == 4 and summary["pages_with_transcripts"] == 1
    assert 0 <= summary["cer_codes_vs_uncompressed"] < 0.5  # the shipped quantizer mostly agrees with the base
    assert summary["cer_codes"] < 0.5
    assert [line.split()[0] for line in lines[1:-1]] == ["a.png", "sub/b.jpg", "sub/doc.pdf#1", "sub/doc.pdf#2"]

    # the same codes against themselves: a quantizer that passes the features through unchanged agrees exactly
    class Identity(torch.nn.Module):
        def encode(self, f):
            return f

        def decode(self, c):
            return c

    model = load_model(NANO)
    same = self_reading.agreement_report(model, Identity(), scans, "base", tmp_path / "cache", 200)["summary"]
    assert same["cer_codes_vs_uncompressed"] == 0 and same["identical_pages"] == 4


def test_error_rates_keep_their_definition():
    """Unit-cost Levenshtein distance over the reference's length: characters for CER, words for WER."""
    from ocr_latent.training.reading_metrics import cer, edit_distance, wer
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("ü", "u") == 1
    assert cer("Straße", "Strasse") == 2 / 7 and cer("", "") == 0 and cer("abc", "") == 3
    assert wer("the cat sat", "the cat sat down") == 0.25 and wer("a b", "b a") == 1.0
    assert edit_distance(["a", "b"], ["b"]) == 1


def test_pages_of_several_pdfs_come_from_their_own_file(tmp_path):
    import numpy as np
    from ocr_latent.serving.documents import render_pdf
    pages = list(test_pages(5, seed=3))
    pages[0].image.save(tmp_path / "a.pdf", save_all=True, append_images=[pages[1].image, pages[2].image], resolution=72)
    pages[3].image.save(tmp_path / "b.pdf", save_all=True, append_images=[pages[4].image], resolution=72)
    listed = self_reading.directory_pages(tmp_path, "base")
    assert [name for name, _ in listed] == ["a.pdf#1", "a.pdf#2", "a.pdf#3", "b.pdf#1", "b.pdf#2"]
    rendered = {f"{f}#{n}": image for f in ("a.pdf", "b.pdf") for n, image in render_pdf((tmp_path / f).read_bytes(), "base")}
    assert all(np.array_equal(np.asarray(load()), np.asarray(rendered[name])) for name, load in listed)
