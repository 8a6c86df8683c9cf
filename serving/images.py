"""Image files as page views, with Pillow alone (no torch: the image workers of serving/workers.py run this).

An upload is judged from its header before any pixel is decoded (`probe_image`: format, pixel count, a
JPEG's length and number of scans against what it claims), then decoded, a large page reduced as it is
(`decode_image`), and made no larger than the encoder's view (`page_for_encoder`). `decoded_bytes` says, from the header,
what decoding it will hold. Every failure is a DocumentError with the status the HTTP face answers.
"""
from __future__ import annotations

import ctypes
import functools
import io
import re

from PIL import Image

from ocr_latent.views import MODES, load_image, make_view


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
    a JPEG whose header claims more pixels than its bytes can hold, or that has more scans than an encoder
    writes (`check_jpeg_scans`). With the view `mode` it will be made
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
        check_jpeg_scans(data)
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


MAX_JPEG_SCANS = 100  # encoders write 1 (baseline) to a few dozen (progressive: libjpeg's script has 10)


def check_jpeg_scans(data: bytes) -> None:
    """Each scan of a JPEG is a pass over every block of the components it codes: a progressive file that
    repeats its last (tiny) scan 4,000 times is 200 KB that libjpeg decodes for half a minute. Refused from
    the count of scans before any is decoded."""
    scans = jpeg_scans(data, MAX_JPEG_SCANS + 1)
    if scans > MAX_JPEG_SCANS:
        raise DocumentError(f"the JPEG has more than {MAX_JPEG_SCANS} scans, which no encoder writes for a page and "
                            f"which would take minutes to decode; save it again as a baseline (or ordinary "
                            f"progressive) JPEG, or as a PNG", 413, "image_too_complex")


def jpeg_scans(data: bytes, most: int) -> int:
    """The scans (SOS markers) of a JPEG's first image, counted up to `most`, walking its markers (entropy-coded
    data is skipped to the next marker: a 0xFF there is followed by a stuffed 0x00 or a restart marker)."""
    i, scans = 2, 0
    while i + 4 <= len(data) and scans < most:
        if data[i] != 0xFF:
            return scans  # not a marker where one must be: the decoder will say what is wrong
        marker = data[i + 1]
        if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:  # fill byte, markers without a length
            i += 1 if marker == 0xFF else 2
            continue
        if marker == 0xD9:
            return scans
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:
            scans += 1
            while (i := data.find(b"\xff", i)) != -1 and i + 1 < len(data) and (
                    data[i + 1] == 0 or 0xD0 <= data[i + 1] <= 0xD7):
                i += 2
            if i == -1:
                return scans
    return scans


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


def page_for_encoder(data: bytes, max_pixels: int, mode: str) -> tuple[Image.Image, int]:
    """An image file -> (what the encoder makes its view of, what decoding it held at most, bytes): the page
    as `open_image` decodes it when it has no more pixels than the view, else the view itself (the very view
    `views.make_view` would make of that page: making it again is exact). Either way at most a view's pixels
    leave the worker, and the encoder's view of it is the one it would make of the page decoded in process."""
    image = probe_image(data, max_pixels, mode)
    held = decoded_bytes(image, mode)
    page = decode_image(image, mode)
    if page.width * page.height <= MODES[mode][0] ** 2:
        return page, held
    try:
        return make_view(page, mode), held
    except MemoryError:
        raise DocumentError("image too large to decode", 413, "image_too_large") from None


def view_bytes(mode: str) -> int:
    """What a view in `mode` holds: size x size RGB, as Pillow stores it (4 bytes a pixel); the most a page
    from `page_for_encoder` holds."""
    return MODES[mode][0] ** 2 * 4


TRIM_FROM_BYTES = 32 << 20  # an image whose decoding held this much has its freed memory given back at once


@functools.cache
def _libc():
    return ctypes.CDLL(None)


def trim_memory() -> bool:
    """Give the free pages of every malloc arena back to the system (glibc's malloc_trim). glibc keeps what
    a thread freed in that thread's arena, for that thread: after 8 concurrent 6000x6600 PNGs, each decoded
    on a thread of its own, the server stayed 1 GB larger for good; a trim gave it back (to 70 MB above
    idle; docs/performance.md). Called after large decodes only: it walks every arena. False where the C
    library has no malloc_trim (not glibc)."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def plain(error: Exception) -> str:
    """A library's message for a user: without object reprs ("<_io.BytesIO object at 0x7f...>")."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-f]+>", "", str(error)).strip() or type(error).__name__
