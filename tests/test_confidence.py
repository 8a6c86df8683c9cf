"""How far to trust a reading (issue 56): every reading carries a confidence and every encoded page a fidelity,
from the calibration shipped beside the embedded quantizer; a page read well gets a high confidence, garbage
a low one; an opt-in early stop ends garbage early. In process (the engine), then through HTTP."""
import numpy as np
import pytest
from PIL import Image, ImageDraw

from conftest import ROOT, serving
from ocr_latent.serving.confidence import Calibration, calibration_path, fit_logistic, reading_features
from ocr_latent.serving.engine import Engine, EngineConfig
from ocr_latent.training.pages import test_pages
from ocr_latent.training.reading_metrics import cer

CALIBRATION = calibration_path(ROOT / "weights" / "nano" / "quantizer.safetensors")


def picture() -> Image.Image:
    """A picture without text: shapes on white."""
    image = Image.new("RGB", (1024, 1024), "white")
    draw = ImageDraw.Draw(image)
    for i, colour in enumerate(["red", "navy", "green", "orange"]):
        draw.ellipse((80 + 200 * i, 150 + 90 * i, 380 + 200 * i, 500 + 90 * i), fill=colour)
    draw.rectangle((100, 700, 900, 900), fill=(120, 60, 20))
    return image


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(torch_threads=1, decode_slots=16)).start()
    e.wait_ready(60)
    yield e
    e.stop()


def read(engine, images, **options):
    codes = [engine.encode(im) for im in images]
    codes = [(j.future.result(120), j.fidelity) for j in codes]
    results = [engine.decode(c, "free", 512, **options) for c, _ in codes]
    return [c for c, _ in codes], [f for _, f in codes], [j.future.result(300) for j in results]


def test_the_embedded_quantizer_ships_its_calibration():
    calibration = Calibration.load(CALIBRATION)
    assert len(calibration.weights) == 6 and calibration.fitted["pages"] >= 100
    assert np.asarray(calibration.code_logfreq).shape == (16, 16)


def test_a_page_read_well_is_trusted_and_garbage_is_not(engine):
    """The example page (read nearly letter for letter) gets a high confidence; a picture read as text, a blank
    page read as anything, or damaged codes get a lower one; a blank page read as nothing is faithful."""
    example = Image.open(ROOT / "examples" / "page.png").convert("RGB")
    blank = Image.new("RGB", (1024, 1024), "white")
    codes, fidelity, (good, pic, empty) = read(engine, [example, picture(), blank])
    assert cer(good.text, (ROOT / "examples" / "page.txt").read_text().strip()) < 0.1
    assert good.confidence > 0.5, good
    assert all(0 <= f <= 1 for f in fidelity)
    if pic.text.strip():  # a picture read as text
        assert pic.confidence < 0.5 and pic.confidence < good.confidence - 0.3, pic
    if empty.text.strip():  # a blank page read as something
        assert empty.confidence < 0.5, empty
    else:  # read as nothing: faithful
        assert empty.confidence > 0.5, empty
    rng = np.random.default_rng(0)
    damaged = codes[0].copy()
    flip = rng.choice(damaged.size, damaged.size // 4, replace=False)
    damaged[flip] = rng.integers(0, 16, flip.size)  # a quarter of the codes changed (a checksum made anew)
    [hurt] = [engine.decode(damaged, "free", 512).future.result(300)]
    assert hurt.confidence < good.confidence - 0.2, (hurt, good)


def test_confidence_and_fidelity_do_not_depend_on_the_company(engine):
    pages = [p.image for p in test_pages(16, seed=2)]
    _, alone_fid, [alone] = read(engine, pages[:1])
    _, together_fid, together = read(engine, pages)
    assert alone.text == together[0].text
    assert alone.confidence == pytest.approx(together[0].confidence, abs=1e-3)
    assert alone_fid[0] == pytest.approx(together_fid[0], abs=1e-3)


def test_the_early_stop_ends_garbage_and_is_off_by_default(engine):
    example = Image.open(ROOT / "examples" / "page.png").convert("RGB")
    codes, _, (plain_pic, plain_good) = read(engine, [picture(), example])
    stopped = [engine.decode(c, "free", 512, min_confidence=0.1).future.result(300) for c in codes]
    assert stopped[1].text == plain_good.text and stopped[1].finish_reason == plain_good.finish_reason
    if plain_pic.confidence < 0.05 and plain_pic.num_tokens > 64:
        assert stopped[0].finish_reason == "low_confidence" and stopped[0].num_tokens < plain_pic.num_tokens
    calibration, engine.pipeline.calibration = engine.pipeline.calibration, None
    try:  # a quantizer without a calibration: the option is refused, not ignored
        with pytest.raises(ValueError, match="train.py confidence"):
            engine.decode(codes[0], "free", 64, min_confidence=0.5)
    finally:
        engine.pipeline.calibration = calibration


def test_the_logistic_fit_separates_what_it_is_given():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 2))
    y = (x[:, 0] - 0.5 * x[:, 1] + 0.3 * rng.normal(size=400) > 0).astype(float)
    w, b = fit_logistic(x * [3.0, 0.01] + [1.0, 5.0], y)  # raw scales: the fit standardises inside
    p = 1 / (1 + np.exp(-((x * [3.0, 0.01] + [1.0, 5.0]) @ w + b)))
    assert ((p > 0.5) == (y > 0.5)).mean() > 0.9
    f = reading_features([-0.01] * 40 + [-3.0] * 20, "length", -2.0)
    assert f[3] == 0 and f[1] < -2.5 and 0.3 < f[2] < 0.4


def test_http_replies_carry_confidence_and_fidelity(tmp_path):
    with serving(tmp_path, "confidence") as srv:
        import httpx
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            png = (ROOT / "examples" / "page.png").read_bytes()
            enc = c.post("/encode", content=png, headers={"Content-Type": "image/png"}).json()
            assert 0 <= enc["fidelity"] <= 1
            dec = c.post("/decode", json={"codes_b64": enc["codes_b64"], "max_tokens": 256}).json()
            assert dec["confidence"] > 0.5, dec
            olc = c.post("/encode?format=olc", content=png, headers={"Content-Type": "image/png"})
            assert float(olc.headers["x-fidelity"]) == pytest.approx(enc["fidelity"], abs=1e-4)
            pages = c.post("/decode", content=olc.content, params={"max_tokens": 256},
                           headers={"Content-Type": olc.headers["content-type"]}).json()["pages"]
            assert pages[0]["confidence"] == pytest.approx(dec["confidence"], abs=1e-3)
            with c.stream("POST", "/decode", json={"codes_b64": enc["codes_b64"], "max_tokens": 256,
                                                   "stream": True}) as r:
                done = [line for line in r.iter_lines() if line.startswith("data:")][-1]
            assert '"confidence"' in done
            metrics = c.get("/metrics").text
            assert "ocr_latent_decode_confidence_count" in metrics and "ocr_latent_encode_fidelity_count" in metrics
            bad = c.post("/decode", json={"codes_b64": enc["codes_b64"], "min_confidence": 2})
            assert bad.status_code == 422
