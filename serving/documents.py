"""Documents as page images: an image file opened within its limits (`open_image`), and PDF pages
rendered with PDFium (pypdfium2) at the size the encoder's view mode takes.

PDFium runs in worker processes (serving/pdf_worker.py), never in this one: each has a memory limit, and
each answer a deadline, after which the worker is killed and replaced, so a PDF that draws without end
costs a worker, not the server (and PDFium, which is not thread-safe, is only ever called from one
thread of a worker). Rendering is sized from the page's own dimensions, so a hostile page size cannot
make a huge bitmap.
"""
from __future__ import annotations

import contextlib
import io
import re
import threading

from PIL import Image

from ocr_latent.encoder import MODES, load_image
from ocr_latent.serving.pdf_worker import Cancelled, Limits, PdfPool, RenderError

PDF_MAGIC = b"%PDF-"
_pool: PdfPool | None = None
_pool_lock = threading.Lock()


class DocumentError(ValueError):
    """An image or PDF that cannot be read, or a page selection that does not fit it; the message says
    which. `status` and `type` are what the HTTP face answers (README "Errors")."""

    TYPES = {413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_document"}

    def __init__(self, message: str, status: int = 422, type: str | None = None):
        super().__init__(message)
        self.status, self.type = status, type or self.TYPES.get(status, "invalid_document")


# what /encode decodes (spec: PNG, JPEG, WebP, TIFF, BMP; MPO is how Pillow opens multi-picture camera
# JPEGs). Formats outside this list (EPS, which shells out to Ghostscript, PSD, ICO, ...) are a 415.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "TIFF", "BMP")


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image (EXIF orientation applied: encoder.load_image, the one time it runs for a page).
    The pixel count is checked from the header before the pixels are decoded: a DocumentError 413
    (image_too_large) over `max_pixels`, 415 for anything that is not a supported image (any decoder
    failure on bad bytes is the client's fault, never a 5xx)."""
    Image.init()
    try:
        image = Image.open(io.BytesIO(data), formats=[f for f in IMAGE_FORMATS if f in Image.OPEN])
    except Image.DecompressionBombError as e:
        raise DocumentError(f"image too large: {e}", 413, "image_too_large") from None
    except Exception:  # noqa: BLE001 - UnidentifiedImageError, or a plugin choking on bad bytes
        raise DocumentError(f"not a supported image ({', '.join(IMAGE_FORMATS)}) or a PDF", 415) from None
    width, height = image.size
    if width * height > max_pixels:
        raise DocumentError(f"image is {width}x{height} = {width * height} pixels; the limit "
                            f"is {max_pixels} (MAX_IMAGE_PIXELS)", 413, "image_too_large")
    if width < 1 or height < 1:
        raise DocumentError(f"image has no pixels ({width}x{height})", 415)
    try:
        image.load()
        return load_image(image)
    except Image.DecompressionBombError as e:
        raise DocumentError(f"image too large: {e}", 413, "image_too_large") from None
    except MemoryError:
        raise DocumentError("image too large to decode", 413, "image_too_large") from None
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data
        raise DocumentError(f"could not decode the image: {plain(e)}", 415) from None


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


def plain(error: Exception) -> str:
    """A library's message for a user: without object reprs ("<_io.BytesIO object at 0x7f...>")."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-f]+>", "", str(error)).strip() or type(error).__name__


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


def settings_limits(s=None) -> Limits:
    """The PDF workers' limits in these settings (default: the environment's): PDF_WORKERS,
    PDF_MEMORY_BYTES, PDF_DEADLINE_S."""
    if s is None:
        from ocr_latent.serving.settings import settings
        s = settings()
    return Limits(s.pdf_workers, s.pdf_memory_bytes, s.pdf_deadline_s)


def pdf_pool() -> PdfPool:
    """The process's own pool of PDF workers (for callers that bring none: bulk jobs, training), made on
    first use; its workers start when first needed."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PdfPool(settings_limits())
        return _pool


def close_pdf_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


def page_count(data: bytes, cancel: threading.Event | None = None, pool: PdfPool | None = None) -> int:
    with (pool or pdf_pool()).lease() as worker, _as_document_error():
        count = worker.call({"op": "open"}, data, cancel)[0]["pages"]
        worker.call({"op": "close"}, cancel=cancel)
        return count


def render_pdf(data: bytes, mode: str, pages: str | None = None, max_pages: int = 32,
               cancel: threading.Event | None = None, pool: PdfPool | None = None) -> list[tuple[int, Image.Image]]:
    """PDF bytes -> [(page number, 1-based; RGB image)] for the selected pages, each rendered so that its
    longer side is the mode's view size (white background, as printed). Rendered by a worker process
    within its limits (serving/pdf_worker.py): a page over them is a DocumentError 413
    (document_too_complex); setting `cancel` stops the render (its worker is killed: `Cancelled`). `pool`:
    the workers to use (default: this process's own, `pdf_pool()`)."""
    size = MODES[mode][0]
    if cancel is not None and cancel.is_set():
        raise Cancelled()
    with (pool or pdf_pool()).lease() as worker, _as_document_error():
        count = worker.call({"op": "open"}, data, cancel)[0]["pages"]
        if count == 0:
            raise DocumentError("the PDF has no pages", 422)
        chosen = parse_pages(pages, count)
        if len(chosen) > max_pages:
            raise DocumentError(f"{len(chosen)} pages selected; at most {max_pages} per request (MAX_PAGES): "
                                f"choose some with pages=, e.g. pages=1-{max_pages}", 413)
        out = []
        for index in chosen:
            meta, pixels = worker.call({"op": "render", "index": index, "size": size}, cancel=cancel)
            out.append((index + 1, Image.frombytes("RGB", (meta["width"], meta["height"]), pixels)))
        worker.call({"op": "close"}, cancel=cancel)
        return out


@contextlib.contextmanager
def _as_document_error():
    try:
        yield
    except RenderError as e:
        raise DocumentError(str(e), e.status, e.type) from None
