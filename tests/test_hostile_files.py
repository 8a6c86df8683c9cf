"""What a file or a request can do to the server and the CLI: each case a hostile tester or a new
user met, as a regression test. Damaged and lying documents get a clear 4xx, never a 5xx or a Python
repr; codes that changed after they were written are refused naming the page; an image costs the
server what its header says it will, within a budget, and not for longer than its request."""
import asyncio
import concurrent.futures
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageOps, PngImagePlugin

from conftest import ROOT, assert_error, png_bytes, rss_bytes, serving
from ocr_latent.examples.hostile import lying_jpeg, pdf
from ocr_latent.client.codesfile import MEDIA_TYPE, CodesFile, pack
from ocr_latent.serving.documents import (Cancelled, DocumentError, Limits, OutOfTime, WorkerPool, decoded_bytes,
                                          image_view, open_image, probe_image)
from ocr_latent.serving.images import jpeg_scans
from ocr_latent.views import make_view
from ocr_latent.serving.guard import DecodeBudget
from ocr_latent.serving.http_errors import ApiError
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


# ----------------------------------------------------------------------------- what an image costs (issue 30)
def large_page(width: int = 4400, height: int = 4200) -> Image.Image:
    """A white page over 4x the 1024-pixel view, a black block in its top left corner."""
    page = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(page).rectangle((200, 100, 1400, 700), fill="black")
    return page


def test_a_jpeg_whose_header_claims_more_than_its_data_holds_is_refused_cheaply(server, client):
    data = lying_jpeg()
    assert len(data) < 400
    before = rss_bytes(server.proc.pid)
    for _ in range(4):
        err = assert_error(client.post("/encode", content=data, headers={"Content-Type": "image/jpeg"}), 415)
        assert "ends before its image does" in err["message"] and "6600x6000" in err["message"], err
    grown = rss_bytes(server.proc.pid) - before
    assert grown < 30 << 20, f"4 lying JPEGs grew the server by {grown >> 20} MiB"
    whole = png_bytes(Image.new("RGB", (600, 400), "white"), "JPEG")  # a whole JPEG still reads
    assert client.post("/encode", content=whole, headers={"Content-Type": "image/jpeg"}).status_code == 200


def test_a_large_page_is_reduced_as_it_is_decoded_and_turned_upright_once():
    page = large_page()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: shown upright after a quarter turn clockwise
    data = png_bytes(page, exif=exif.tobytes())
    read = open_image(data, 40_000_000, "base")
    assert read.size == (2100, 2200) and read.mode == "RGB" and read.getexif().get(0x0112) is None
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB").reduce(2)
    assert np.array_equal(np.asarray(read), np.asarray(upright))
    # a JPEG decodes at half its size straight away, and costs that: a quarter of the whole page's pixels
    jpeg = probe_image(png_bytes(page, "JPEG"), 40_000_000, "base")
    assert jpeg.size == (2200, 2100) and decoded_bytes(jpeg, "base") == 2200 * 2100 * 4
    # below 4x the view a page is read as it always was
    small = Image.new("RGB", (3000, 2000), "white")
    assert np.array_equal(np.asarray(open_image(png_bytes(small), 40_000_000, "base")), np.asarray(small))


def test_the_decode_budget_takes_images_in_turn_and_refuses_with_retry_after():
    async def scenario():
        budget, order = DecodeBudget(100, max_waiting=1, wait_s=0.5, retry_after_s=3), []

        async def take(name: str, nbytes: int, hold_s: float):
            async with budget.hold(nbytes):
                order.append(name)
                await asyncio.sleep(hold_s)

        first = asyncio.create_task(take("a", 60, 0.2))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(take("b", 60, 0))
        await asyncio.sleep(0.01)
        assert budget.used == 60 and len(budget.waiting) == 1
        with pytest.raises(ApiError) as refused:  # does not fit, and one already waits (MAX_QUEUE=1)
            async with budget.hold(50):
                pass
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "3"}
        assert "IMAGE_MEMORY_BYTES" in refused.value.message
        await asyncio.gather(first, second)
        assert order == ["a", "b"] and budget.used == 0
        async with budget.hold(10 ** 9):  # larger than the whole budget: decoded alone
            assert budget.used == 100
        slow = asyncio.create_task(take("c", 100, 1.0))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as late:  # waited wait_s for its turn
            async with budget.hold(1):
                pass
        assert late.value.status == 503 and "0.5 s" in late.value.message
        gone = asyncio.create_task(take("d", 50, 0))  # its client leaves while it waits
        await asyncio.sleep(0.01)
        gone.cancel()
        await slow
        assert budget.used == 0 and not budget.waiting and order == ["a", "b", "c"]
    asyncio.run(scenario())


def test_large_images_decode_within_the_budget_and_their_memory_goes_back(tmp_path):
    data = png_bytes(large_page())
    with serving(tmp_path, "budget", IMAGE_MEMORY_BYTES=1 << 20, MAX_QUEUE=1) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        assert c.post("/encode", content=png_bytes(Image.new("RGB", (512, 512), "white")),
                      headers={"Content-Type": "image/png"}).status_code == 200
        before = rss_bytes(srv.proc.pid)

        def send(_):
            with httpx.Client(base_url=srv.url, timeout=120) as each:
                return each.post("/encode", content=data, headers={"Content-Type": "image/png"})
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(send, range(4)))
        statuses = sorted(r.status_code for r in replies)
        print(f"4 concurrent 4400x4200 pages, one decoding at a time, one waiting: {statuses}")
        assert set(statuses) <= {200, 503} and 200 in statuses, [r.text[:200] for r in replies]
        for r in replies:
            if r.status_code == 503:
                err = assert_error(r, 503)
                assert err["type"] == "overloaded" and "IMAGE_MEMORY_BYTES" in err["message"]
                assert r.headers["retry-after"]
        assert len({tuple(r.json()["codes"]) for r in replies if r.status_code == 200}) == 1
        kept = rss_bytes(srv.proc.pid) - before
        print(f"server RSS after them: {kept >> 20:+d} MiB")
        assert kept < 64 << 20, f"the server kept {kept >> 20} MiB after 4 large pages (see images.trim_memory)"


def test_the_decode_budget_lets_what_fits_go_ahead_but_not_for_ever():
    """A small image that fits what is free goes ahead of a large one waiting for room; once the large one has
    waited PATIENCE_S, turns go in order and the small ones wait behind it (it is not starved)."""
    async def scenario():
        budget, order = DecodeBudget(100, max_waiting=8, wait_s=5, retry_after_s=1), []
        budget.PATIENCE_S = 0.3

        async def take(name: str, nbytes: int, hold_s: float):
            async with budget.hold(nbytes):
                order.append(name)
                await asyncio.sleep(hold_s)

        holders = [asyncio.create_task(take(f"held{i}", 30, 0.6)) for i in range(2)]  # 60 of 100, for 0.6 s
        await asyncio.sleep(0.01)
        large = asyncio.create_task(take("large", 90, 0))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(take("small", 20, 0))  # fits the 40 free: goes ahead of the large one
        await asyncio.sleep(0.05)
        assert order[-1] == "small" and "large" not in order
        await asyncio.sleep(0.3)  # the large one has now waited longer than PATIENCE_S
        late = asyncio.create_task(take("late", 20, 0))  # would fit, but waits its turn behind the large one
        await asyncio.sleep(0.05)
        assert "late" not in order and budget.waiting
        await asyncio.gather(*holders, large, small, late)
        assert order.index("large") < order.index("late") and budget.used == 0
    asyncio.run(scenario())


def scan_bomb(side: int = 2000, scans: int = 400) -> bytes:
    """A progressive JPEG whose last scan is repeated: `scans` passes over a side x side page in a few KB."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 255).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")
    end = data.rindex(b"\xff\xd9")
    return data[:end] + data[last:end] * (scans - 1) + data[end:]


def test_a_jpeg_of_too_many_scans_is_refused_from_its_markers_before_decoding():
    bomb = scan_bomb(2000, 400)
    assert 400 < jpeg_scans(bomb, 10 ** 6) < 410  # the encoder's own scans, and the repeated one
    with pytest.raises(DocumentError) as refused:
        probe_image(bomb, 40_000_000, "base")
    assert refused.value.status == 413 and refused.value.type == "image_too_complex"
    assert "scans" in str(refused.value)
    progressive = png_bytes(Image.new("RGB", (300, 200), "white"), "JPEG", progressive=True)
    assert jpeg_scans(progressive, 1000) == 10  # libjpeg's standard progressive script
    probe_image(progressive, 40_000_000, "base")


def test_image_workers_make_the_view_the_encoder_would_and_stop_what_overruns():
    """The encoder's view of what a worker hands back (the page, or its view when the page is larger) is the one
    it makes of the page decoded in process (so codes are unchanged), and no more than a view's pixels come
    back; a decode past IMAGE_DEADLINE_S, or whose caller cancels, has its worker killed."""
    pages = test_pages(2, seed=2)
    rotated = pages[1].image.rotate(90, expand=True)
    exif = rotated.getexif()
    exif[0x0112] = 6
    files = [png_bytes(pages[0].image), png_bytes(pages[1].image.convert("P")),
             png_bytes(rotated, "JPEG", exif=exif), png_bytes(large_page()), png_bytes(Image.new("L", (5000, 3000), 255), "JPEG")]
    pool = WorkerPool(Limits(workers=1, memory_bytes=1 << 30, deadline_s=20, kind="image"))
    try:
        for data in files:
            want = make_view(open_image(data, 40_000_000, "base"), "base")
            page = image_view(data, "base", 40_000_000, pool)
            assert page.width * page.height <= 1024 * 1024
            assert np.array_equal(np.asarray(make_view(page, "base")), np.asarray(want))
        with pytest.raises(DocumentError) as refused:
            image_view(b"GIF89a not an image we read", "base", 40_000_000, pool)
        assert refused.value.status == 415
        slow = scan_bomb(6000, 90)  # under the scan limit, seconds to decode at 6000x6000
        pool.limits.deadline_s = 0.3
        with pytest.raises(DocumentError) as late:
            image_view(slow, "base", 40_000_000, pool)
        assert late.value.status == 413 and "IMAGE_DEADLINE_S" in str(late.value)
        pool.limits.deadline_s = 20
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        started = time.monotonic()
        with pytest.raises(Cancelled):
            image_view(slow, "base", 40_000_000, pool, cancel)
        assert time.monotonic() - started < 2
        with pytest.raises(OutOfTime):
            image_view(slow, "base", 40_000_000, pool, until=time.monotonic() + 0.3)
        assert image_view(files[3], "base", 40_000_000, pool).size == (1024, 1024)  # a fresh worker took over
    finally:
        pool.close()
