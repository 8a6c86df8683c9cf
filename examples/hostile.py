"""Hostile files, made on demand for the tests and bench/hostile_load.py: small PDFs whose drawing expands
(nested forms), PDFs with a hand-written object list, and a JPEG whose header claims more than its data holds.

    python -m ocr_latent.examples.hostile DIR   # writes million.pdf (10^6 rectangles) and lying.jpg into DIR
"""
from __future__ import annotations

import io

from PIL import Image


def pdf(objects: list[str]) -> bytes:
    """A PDF of these numbered objects (1 is the catalog) with a correct cross-reference table."""
    out, offsets = io.BytesIO(), []
    out.write(b"%PDF-1.4\n")
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n{body}\nendobj\n".encode())
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    out.write("".join(f"{o:010d} 00000 n \n" for o in offsets).encode())
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode())
    return out.getvalue()


def stream(entries: str, content: str) -> str:
    return f"<< {entries} /Length {len(content)} >>\nstream\n{content}\nendstream"


def bomb(levels: int = 7, fanout: int = 10) -> bytes:
    """One page whose content draws form 5; each form draws the one below it `fanout` times, the last one
    fills a rectangle: fanout ** (levels - 1) rectangles in a file of a few KB."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] /Contents 4 0 R "
               "/Resources << /XObject << /X 5 0 R >> >> >>", stream("", "/X Do")]
    for level in range(levels):
        last = level == levels - 1
        resources = "" if last else f"/Resources << /XObject << /X {6 + level} 0 R >> >>"
        content = "0 0 1 rg 10 10 100 100 re f" if last else " ".join(["/X Do"] * fanout)
        objects.append(stream(f"/Type /XObject /Subtype /Form /BBox [0 0 200 200] {resources}", content))
    return pdf(objects)


def lying_jpeg(width: int = 6600, height: int = 6000) -> bytes:
    """An 8x8 grey JPEG (332 bytes) whose frame header (SOF0) claims width x height: the data ends after one block."""
    buf = io.BytesIO()
    Image.new("L", (8, 8), 90).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    (out / "million.pdf").write_bytes(bomb(7, 10))
    (out / "lying.jpg").write_bytes(lying_jpeg())
    print(f"wrote {out / 'million.pdf'} and {out / 'lying.jpg'}")
