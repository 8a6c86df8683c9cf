"""Documents as page images: an image file opened within its limits (`open_image`: its header read and
judged first, `probe_image`; then decoded, a large page reduced as it is, `decode_image`), and PDF pages
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


def open_image(data: bytes, max_pixels: int, mode: str | None = None) -> Image.Image:
    """Bytes -> RGB image, upright (EXIF orientation applied): `probe_image` then `decode_image`."""
    return decode_image(probe_image(data, max_pixels, mode), mode)


def probe_image(data: bytes, max_pixels: int, mode: str | None = None) -> Image.Image:
    """Bytes -> an image whose header is read and whose pixels are not yet decoded. The pixel count is
    checked from the header: a DocumentError 413 (image_too_large) over `max_pixels`, 415 for anything that
    is not a supported image (any decoder failure on bad bytes is the client's fault, never a 5xx), and for
    a JPEG whose header claims more pixels than its bytes can hold. With the view `mode` it will be made
    into, a large JPEG is set to decode at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT scaling, never below
    twice the view): `decoded_bytes` then says what decoding it will hold."""
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
    if image.format in ("JPEG", "MPO"):
        check_jpeg_length(data, width, height)
        fx, fy = reduction(image.size, mode)
        if (fx, fy) != (1, 1):
            image.draft(None, (width // fx, height // fy))
    return image


def check_jpeg_length(data: bytes, width: int, height: int) -> None:
    """A Huffman-coded JPEG spends at least one bit on every 8x8 block of its first scan, and even at the
    coarsest chroma sampling a component has a block per 32x32 pixels; a file shorter than that claims an
    image its data does not hold (libjpeg would grey-fill the rest, at the cost of the claimed size)."""
    frame = jpeg_frame(data)
    if frame not in (0xC0, 0xC1, 0xC2, 0xC3):  # arithmetic coding can take less than a bit a block
        return
    least = -(-width // 32) * -(-height // 32) // 8
    if len(data) < least:
        raise DocumentError(f"the JPEG's data ends before its image does: its header says {width}x{height} pixels, "
                            f"which take at least {least:,} bytes, and the file has {len(data):,}; send the whole "
                            f"file", 415)


def jpeg_frame(data: bytes) -> int | None:
    """The marker of a JPEG's frame header (0xC0 baseline, 0xC2 progressive, ...), or None."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF or 0xD0 <= marker <= 0xD8 or marker == 0x01:  # fill byte, markers without a length
            i += 1 if marker == 0xFF else 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker
        if marker in (0xD9, 0xDA):  # the end, or a scan before any frame
            return None
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def reduction(size: tuple[int, int], mode: str | None) -> tuple[int, int]:
    """Whole factors by which a page of `size` can shrink and stay at least twice the view that `mode` makes
    of it (letterboxed modes keep its aspect): the view then loses nothing visible, and a 6000x6600 scan is
    held at 2000x2200, not at full size until the engine gets to it. (1, 1) without a mode."""
    if mode is None:
        return 1, 1
    view, letterbox = MODES[mode]
    w, h = size
    if letterbox:
        return (f := max(1, max(w, h) // (2 * view))), f
    return max(1, w // (2 * view)), max(1, h // (2 * view))


REDUCIBLE = ("L", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F")  # Image.reduce's modes; P, 1, I;16 are not
ORIENTATIONS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
                5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
                8: Image.Transpose.ROTATE_90}  # EXIF orientation -> the transpose that makes the page upright


def decoded_bytes(image: Image.Image, mode: str | None = None) -> int:
    """The most memory that decoding a probed image holds at once, from its header: its pixels as Pillow
    stores them (4 bytes a pixel for RGB, which it keeps as RGBX; 1 for L, P, 1), an RGB copy where its
    mode must be converted before it is reduced, and the reduced (or converted) RGB page."""
    w, h = image.size
    fx, fy = reduction(image.size, mode)
    full = w * h * (1 if image.mode in ("1", "L", "P") else 4)
    reduced = (fx, fy) != (1, 1)
    converted = w * h * 4 if reduced and image.mode not in REDUCIBLE else 0
    return full + converted + ((w // fx) * (h // fy) * 4 if reduced or image.mode != "RGB" else 0)


def decode_image(image: Image.Image, mode: str | None = None) -> Image.Image:
    """A probed image -> RGB, upright; a page of at least four times `mode`'s view is reduced by a whole
    factor (`reduction`, Image.reduce's box filter) as soon as it is decoded, and its full-size pixels freed."""
    try:
        image.load()
        fx, fy = reduction(image.size, mode)
        if (fx, fy) == (1, 1):
            return load_image(image)
        orientation = image.getexif().get(0x0112, 1)
        source = image if image.mode in REDUCIBLE else image.convert("RGB")
        reduced = source.reduce((fx, fy))
        image.close()  # the full-size pixels go now, not when the caller lets go
        source.close()
        reduced.info = {}  # no EXIF left to rotate it by again (encoder.load_image)
        if orientation in ORIENTATIONS:
            reduced = reduced.transpose(ORIENTATIONS[orientation])
        return reduced if reduced.mode == "RGB" else reduced.convert("RGB")
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
