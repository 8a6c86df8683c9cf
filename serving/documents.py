"""Documents as page images: an image file made into the encoder's view within its limits (`image_view`;
serving/images.py judges it from its header, decodes it, reduces a large page as it is decoded), and PDF
pages rendered with PDFium (pypdfium2) at the size the encoder's view mode takes.

Both run in worker processes (serving/workers.py), never in this one: each has a memory limit, and each
answer a deadline, after which the worker is killed and replaced, so a PDF that draws without end or an
image whose scans repeat costs a worker, not the server (and PDFium, which is not thread-safe, is only ever
called from one thread of a worker). Rendering is sized from the page's own dimensions, so a hostile page
size cannot make a huge bitmap.
"""
from __future__ import annotations

import contextlib
import re
import threading

from PIL import Image

from ocr_latent.serving.images import (DocumentError, decode_image, decoded_bytes, open_image,  # noqa: F401
                                       plain, probe_image, view_bytes)
from ocr_latent.serving.workers import Cancelled, Limits, OutOfTime, RenderError, WorkerPool  # noqa: F401
from ocr_latent.views import MODES

PDF_MAGIC = b"%PDF-"
_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*", b"BM")


def looks_like_pdf(data: bytes) -> bool:
    """A PDF starts with %PDF-, or has it within its first KiB after junk (PDF 1.7, annex H.3; PDFium
    accepts that too) while not starting as an image does: an image whose metadata mentions
    "%PDF-1.7" is still an image."""
    if data.startswith(PDF_MAGIC):
        return True
    if data.startswith(IMAGE_SIGNATURES) or data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return False
    return PDF_MAGIC in data[:1024]


def parse_pages(spec: str | None, count: int) -> list[int]:
    """ "1-3,5" -> [0, 1, 2, 4] (1-based, inclusive ranges, in the order given); None or "" -> all pages.
    "3-" runs to the last page."""
    if spec is None or not spec.strip():
        return list(range(count))
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d{1,9})\s*(?:(-)\s*(\d{1,9})?\s*)?", part)
        if not m:
            raise DocumentError(f'pages="{spec}": use page numbers and ranges like 1-3,5 or 2- (1-based)', 422)
        first = int(m.group(1))
        last = (int(m.group(3)) if m.group(3) else count) if m.group(2) else first
        if first < 1 or last < first:
            raise DocumentError(f'pages="{spec}": {part.strip()} is not a range of pages from 1 up', 422)
        if last > count:
            raise DocumentError(f'pages="{spec}": the document has {count} page(s)', 422)
        out.extend(range(first - 1, last))
    return out


def settings_limits(s=None, kind: str = "pdf") -> Limits:
    """The workers' limits in these settings (default: the environment's): PDF_WORKERS, PDF_MEMORY_BYTES,
    PDF_DEADLINE_S for PDFs; IMAGE_WORKERS, IMAGE_WORKER_MEMORY_BYTES, IMAGE_DEADLINE_S for images."""
    if s is None:
        from ocr_latent.serving.settings import settings
        s = settings()
    if kind == "image":
        return Limits(s.image_workers, s.image_worker_memory_bytes, s.image_deadline_s, "image")
    return Limits(s.pdf_workers, s.pdf_memory_bytes, s.pdf_deadline_s)


def image_view(data: bytes, mode: str, max_pixels: int, pool: WorkerPool, cancel: threading.Event | None = None,
               until: float | None = None) -> Image.Image:
    """An image file -> the page the encoder makes its view in `mode` of (RGB, upright, no larger than the view:
    images.page_for_encoder), decoded by one of `pool`'s image workers within its limits: a DocumentError for
    what it refuses or what is over them; `cancel` and `until` as `render_pdf`'s."""
    size = MODES[mode][0]
    with pool.lease(cancel, until) as worker, _as_document_error():
        meta, pixels = worker.call({"op": "view", "max_pixels": max_pixels, "mode": mode}, data, cancel, until)
    width, height = meta["width"], meta["height"]
    if width * height > size * size or len(pixels) != width * height * 3:
        raise RenderError(f"the image decoder answered a {width}x{height} page", 503, "unavailable")
    return Image.frombytes("RGB", (width, height), pixels)


def pdf_pool() -> WorkerPool:
    """The process's own pool of PDF workers (for callers that bring none: bulk jobs, training), made on
    first use; its workers start when first needed."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(settings_limits())
        return _pool


def close_pdf_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


def page_count(data: bytes, cancel: threading.Event | None = None, pool: WorkerPool | None = None) -> int:
    with (pool or pdf_pool()).lease() as worker, _as_document_error():
        count = worker.call({"op": "open"}, data, cancel)[0]["pages"]
        worker.call({"op": "close"}, cancel=cancel)
        return count


def render_pdf(data: bytes, mode: str, pages: str | None = None, max_pages: int = 32,
               cancel: threading.Event | None = None, pool: WorkerPool | None = None,
               until: float | None = None) -> list[tuple[int, Image.Image]]:
    """PDF bytes -> [(page number, 1-based; RGB image)] for the selected pages, each rendered so that its
    longer side is the mode's view size (white background, as printed). Rendered by a worker process
    within its limits (serving/workers.py): a page over them is a DocumentError 413
    (document_too_complex); setting `cancel` stops the render (its worker is killed: `Cancelled`), and so
    does time.monotonic() reaching `until` (`OutOfTime`), also while waiting for a worker. `pool`: the
    workers to use (default: this process's own, `pdf_pool()`)."""
    size = MODES[mode][0]
    if cancel is not None and cancel.is_set():
        raise Cancelled()
    with (pool or pdf_pool()).lease(cancel, until) as worker, _as_document_error():
        count = worker.call({"op": "open"}, data, cancel, until)[0]["pages"]
        if count == 0:
            raise DocumentError("the PDF has no pages", 422)
        chosen = parse_pages(pages, count)
        if len(chosen) > max_pages:
            raise DocumentError(f"{len(chosen)} pages selected; at most {max_pages} per request (MAX_PAGES): "
                                f"choose some with pages=, e.g. pages=1-{max_pages}", 413)
        out = []
        for index in chosen:
            meta, pixels = worker.call({"op": "render", "index": index, "size": size}, cancel=cancel, until=until)
            out.append((index + 1, Image.frombytes("RGB", (meta["width"], meta["height"]), pixels)))
        worker.call({"op": "close"}, cancel=cancel, until=until)
        return out


@contextlib.contextmanager
def _as_document_error():
    try:
        yield
    except RenderError as e:
        raise DocumentError(str(e), e.status, e.type) from None
