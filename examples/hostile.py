"""Hostile files, made on demand for the tests and bench/hostile_load.py: small PDFs whose drawing expands
(nested forms), PDFs with a hand-written object list, a JPEG whose header claims more than its data holds,
a progressive JPEG that repeats its last scan thousands of times (`scan_bomb`), and a PDF whose every page
takes PDFium seconds to draw (`slow_pdf`).

    python -m ocr_latent.examples.hostile DIR   # writes million.pdf (10^6 rectangles), lying.jpg,
                                                # scans.jpg (the scan bomb) and slow.pdf (32 slow pages) into DIR
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


def scan_bomb(size_bytes: int = 212_000, side: int = 4000) -> bytes:
    """A progressive greyscale JPEG of side x side (white) whose last scan (an AC refinement scan: its SOS
    segment and ~21 bytes of entropy-coded data, one end-of-band run over every block) is repeated until the
    file is about `size_bytes`, then EOI. libjpeg walks every block of the image once per scan: at 212 KB
    and side 4000, ~3,800 scans, Pillow takes ~25-29 s of CPU to decode it (on the 2-core box); the header
    is an ordinary 4000x4000 one and the file is long enough for its pixels."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 255).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    assert data.endswith(b"\xff\xd9"), "a JPEG ends with EOI"
    # entropy-coded data stuffs every 0xFF with a 0x00, so the last FF DA is the last scan's SOS marker
    last = data.rindex(b"\xff\xda")
    head, scan = data[:-2], data[last:-2]
    repeats = max(0, (size_bytes - len(data)) // len(scan))
    return head + scan * repeats + b"\xff\xd9"


def slow_pdf(pages: int = 32, strokes: int = 30, points: int = 60, draws: int = 4) -> bytes:
    """A PDF of `pages` letter-size pages that all show one content stream: a form XObject of `strokes`
    polylines of `points` random vertices each (dashed 1 on 2, 6 points wide, round caps and joins), drawn
    `draws` times a little offset. PDFium strokes every dash of every segment with round caps: on the 2-core
    box one page takes ~3.3-5 s to render at a longest side of 1024 (4 draws; each draw ~1-1.5 s), under
    PDF_DEADLINE_S (10 s), so a 32-page file (~23 KB) costs a worker a couple of minutes and never a 413."""
    import random

    rnd = random.Random(0)
    paths = []
    for _ in range(strokes):
        xy = [(rnd.randrange(612), rnd.randrange(792)) for _ in range(points)]
        paths.append(f"{xy[0][0]} {xy[0][1]} m " + " ".join(f"{x} {y} l" for x, y in xy[1:]) + " S")
    form = "6 w 1 J 1 j [1 2] 0 d 0 g\n" + "\n".join(paths)
    content = " ".join(f"q 1 0 0 1 {i % 5} {i % 7} cm /F Do Q" for i in range(draws))
    kids = " ".join(f"{5 + i} 0 R" for i in range(pages))
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>",
               stream("/Type /XObject /Subtype /Form /BBox [0 0 612 792]", form), stream("", content)]
    objects += ["<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
                "/Resources << /XObject << /F 3 0 R >> >> >>"] * pages
    return pdf(objects)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    (out / "million.pdf").write_bytes(bomb(7, 10))
    (out / "lying.jpg").write_bytes(lying_jpeg())
    (out / "scans.jpg").write_bytes(scan_bomb())
    (out / "slow.pdf").write_bytes(slow_pdf())
    print(f"wrote million.pdf, lying.jpg, scans.jpg and slow.pdf into {out}")
