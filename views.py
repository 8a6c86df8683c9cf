"""Page views: the square picture DeepSeek-OCR's encoder sees of a page, made with Pillow alone (no torch),
so that the image workers (serving/workers.py) make the very view the encoder would.

Tiny and Small stretch the page to the view; Base and Large keep its aspect, scaled to fit (also up) and
centred on grey, as the original pads (deepseek-ocr-facts.md §2).
"""
from __future__ import annotations

import io

from PIL import Image, ImageOps

# mode -> (view size in pixels, letterbox?). Tiny/Small stretch the page, Base/Large letterbox it.
MODES = {"tiny": (512, False), "small": (640, False), "base": (1024, True), "large": (1280, True)}
PAD_FILL = (127, 127, 127)  # int(0.5 * 255) per channel, as the original pads


def load_image(data: bytes | Image.Image) -> Image.Image:
    """Decode, honour EXIF orientation, convert any mode to RGB. An image that is upright RGB already
    (documents.open_image's, a rendered page, a view) is returned as it is: the work is done once per page."""
    if isinstance(data, Image.Image) and data.mode == "RGB" and data.getexif().get(0x0112, 1) == 1:
        return data  # what exif_transpose(...).convert("RGB") would copy unchanged
    if not isinstance(data, Image.Image):
        data = Image.open(io.BytesIO(data))
        data.load()
    return ImageOps.exif_transpose(data).convert("RGB")


def make_view(image: Image.Image, mode: str) -> Image.Image:
    """A page -> its view (RGB, size x size). A view made already comes back unchanged: making it again is
    a resize to its own size and a paste at (0, 0), both exact."""
    size, letterbox = MODES[mode]
    image = load_image(image)
    if letterbox:  # keep aspect, scale to fit (also up), centre on grey
        return ImageOps.pad(image, (size, size), color=PAD_FILL)
    return image.resize((size, size), Image.Resampling.BICUBIC)
