"""What a file or a request can do to the server and the CLI: each case a hostile tester or a new
user met, as a regression test. Damaged and lying documents get a clear 4xx, never a 5xx or a Python
repr; codes that changed after they were written are refused naming the page."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from conftest import ROOT, assert_error, pdf, png_bytes, serving
from ocr_latent.client.codesfile import MEDIA_TYPE, CodesFile, pack
from ocr_latent.training.pages import test_pages

pytestmark = pytest.mark.slow  # starts servers (~10 s each): left out of the fast lane, `./test.sh -m "not slow"`

KEY = "hostile-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("hostile"), "hostile", API_KEY=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def page():
    return test_pages(1, seed=2)[0]


PAGE = "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] >>"
LYING_COUNT = pdf(["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 5 >>", PAGE])
LOOPING_TREE = pdf(["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>", PAGE])


@pytest.mark.parametrize("name, data", [("lying /Count", LYING_COUNT), ("looping page tree", LOOPING_TREE)],
                         ids=["lying-count", "looping-tree"])
def test_a_pdf_whose_page_tree_lies_gets_a_4xx(client, name, data):
    for pages in ("", "?pages=2", "?pages=1-2"):
        r = client.post("/encode" + pages, content=data, headers={"Content-Type": "application/pdf"})
        assert 400 <= r.status_code < 500, (name, pages, r.status_code, r.text)
        assert_error(r, r.status_code)
    assert client.get("/health").status_code == 200


def test_images_that_mention_pdf_in_their_metadata_are_read_as_images(client, page):
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "printed from a %PDF-1.7 file")
    png = png_bytes(page.image, pnginfo=info)
    jpeg = png_bytes(page.image, "JPEG", quality=90, comment=b"%PDF-1.7 export")
    assert b"%PDF-1.7" in png[:1024] and b"%PDF-1.7" in jpeg[:1024]
    plain = {"image/png": png_bytes(page.image), "image/jpeg": png_bytes(page.image, "JPEG", quality=90)}
    for data, kind in ((png, "image/png"), (jpeg, "image/jpeg")):
        r = client.post("/encode", content=data, headers={"Content-Type": kind})
        assert r.status_code == 200, r.text
        # read as the image it is: the codes of the same pixels without the comment
        want = client.post("/encode", content=plain[kind], headers={"Content-Type": kind})
        assert r.json()["codes"] == want.json()["codes"], kind


def test_messages_show_no_python_reprs_or_regular_expressions(client):
    err = assert_error(client.post("/encode", content=b"hello, not an image", headers={"Content-Type": "image/png"}), 415)
    assert "0x" not in err["message"] and "<" not in err["message"] and "BytesIO" not in err["message"]
    for pages in ("abc", "1;2", "-3"):
        err = assert_error(client.post(f"/encode?pages={pages}", content=LYING_COUNT,
                                       headers={"Content-Type": "application/pdf"}), 422)
        assert "1-3,5" in err["message"] and not any(c in err["message"] for c in "^$\\[]{}"), err
    err = assert_error(client.post("/decode", json={"codes": [0] * 4096, "quantizer": "XYZ"}), 422)
    assert "16 lowercase hex digits" in err["message"] and "[0-9a-f]" not in err["message"]


def test_duplicate_authorization_headers_are_refused(server):
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/metrics", headers=AUTH).status_code == 200
        assert_error(c.get("/metrics", headers=headers), 401)
        assert_error(c.get("/metrics", headers=headers[::-1]), 401)


def test_a_codes_file_with_one_flipped_bit_or_a_foreign_mode_is_refused(client, page):
    made = client.post("/encode?format=olc", content=png_bytes(page.image), headers={"Content-Type": "image/png"})
    assert made.status_code == 200
    doc = CodesFile.from_bytes(made.content)
    two = CodesFile(doc.quantizer, doc.mode, [doc.pages[0], doc.pages[0]]).to_bytes()
    flipped = bytearray(two)
    flipped[-100] ^= 0x01  # a bit of page 2's codes
    err = assert_error(client.post("/decode", content=bytes(flipped), headers={"Content-Type": MEDIA_TYPE}), 422)
    assert err["type"] == "invalid_codes_file" and "page 2" in err["message"]
    tiny = CodesFile(doc.quantizer, "tiny", doc.pages).to_bytes()
    err = assert_error(client.post("/decode", content=tiny, headers={"Content-Type": MEDIA_TYPE}), 422)
    assert "tiny" in err["message"] and "base" in err["message"]
    r = client.post("/decode", content=two, headers={"Content-Type": MEDIA_TYPE}, params={"max_tokens": 8})
    assert r.status_code == 200 and len(r.json()["pages"]) == 2


def ocr_latent(*args: str, url: str = "") -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "ocr-latent"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ocr_latent.client.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OCR_LATENT_URL": url, "OCR_LATENT_API_KEY": KEY})


def test_cli_rough_edges(server, page, tmp_path):
    png = tmp_path / "page.png"
    page.image.save(png)
    r = ocr_latent("encode", str(png), "-o", str(tmp_path / "missing" / "x.olc"), url=server.url)
    assert r.returncode == 1 and b"cannot write" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    r = ocr_latent("encode", str(png), "-o", str(tmp_path / "page.olc"), url=server.url)
    assert r.returncode == 0, r.stderr
    bare = tmp_path / "page.codes"  # the README's raw 2,048 bytes
    bare.write_bytes(pack(CodesFile.from_bytes((tmp_path / "page.olc").read_bytes()).pages[0]))
    from_bare, from_file = (ocr_latent("decode", str(p), url=server.url) for p in (bare, tmp_path / "page.olc"))
    assert from_bare.returncode == 0 and from_bare.stdout == from_file.stdout and from_bare.stdout.strip()
    assert b"name no quantizer" in from_bare.stderr
    r = ocr_latent("train", "--help")
    assert r.returncode == 0 and r.stdout.startswith(b"usage: ocr-latent train")
    r = ocr_latent("serve", "--help")
    assert r.returncode == 0 and b"API_KEY" in r.stdout and b"MODEL_DIR" in r.stdout and b"Configuration" in r.stdout


def test_sigterm_ends_the_server_with_status_0(tmp_path):
    with serving(tmp_path, "sigterm") as srv:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
