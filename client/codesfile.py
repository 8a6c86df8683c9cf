"""The wire format of codes: 4096 codes packed into 2048 bytes, and the `.olc` codes file, pages of
codes that say which quantizer made them and carry checksums (no torch here: the client and CLI
import this).

    offset  size  field
    0       4     magic b"OLC1"
    4       1     format version (2; version 1 files, without checksums, are still read)
    5       1     n = length of the mode name
    6       2     bytes per page (2048: 4096 four-bit codes, two a byte, the first in the high nibble)
    8       4     page count
    12      8     quantizer fingerprint (16 hex digits as 8 bytes; quantizer.ScalarCodes.fingerprint)
    20      n     mode name, ASCII (the view mode the pages were encoded in: "base", ...)
    20+n    4     CRC-32 of bytes 0 .. 20+n (the header)                              [version 2]
    24+n    2052 per page, in page order: 2048 bytes of codes, then the CRC-32 of the page's
                  number (uint32, 1-based) followed by its 2048 bytes                  [version 2]

Integers are little-endian. A version 2 file is exactly 24 + n + pages * 2052 bytes (version 1:
20 + n + pages * 2048, no checksums). Codes decoded by any quantizer but the one that made them give
wrong text without any error, so a reader compares the fingerprint before decoding (the server
answers 409 on a mismatch); codes that changed after they were written read as wrong text too, so
each page carries a checksum, and one that does not match is refused naming the page.

Why CRC-32 (zlib's, as in PNG and gzip): the threat is damage (bit rot, truncation, a page spliced
from another file: the page number is inside its checksum), not forgery, which a keyless check
cannot stop and a keyed one would need a key shared by every reader. CRC-32 catches every burst of
up to 32 flipped bits and is in every language's standard zlib; CRC-32C would need a dependency
here. docs/codes-file.md has the same.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ocr_latent.architecture import FINGERPRINT, MAX_LEVEL, NUM_CODES, PACKED_BYTES, pack, unpack  # noqa: F401

MAGIC = b"OLC1"
VERSION = 2  # what is written; 1 is still read
READABLE = (1, 2)
MODES = ("tiny", "small", "base", "large")  # encoder.MODES, without importing torch
MEDIA_TYPE = "application/vnd.ocr-latent.codes"
SUFFIX = ".olc"
HEADER = struct.Struct("<4sBBHI8s")
CRC = struct.Struct("<I")


class CodesFileError(ValueError):
    """Bytes that are not a codes file this version can read; the message says what is wrong, and
    `page` (1-based) which page when one page is damaged."""

    def __init__(self, message: str, page: int | None = None):
        super().__init__(message)
        self.page = page


def page_checksum(number: int, packed: bytes) -> int:
    return zlib.crc32(packed, zlib.crc32(CRC.pack(number)))


@dataclass
class CodesFile:
    quantizer: str  # the fingerprint, 16 hex digits
    mode: str
    pages: list[np.ndarray]  # each NUM_CODES uint8 codes in 0..MAX_LEVEL
    quantizer_unchecked: bool = False  # made from bare codes: the fingerprint is the reader's, not the writer's

    def __post_init__(self):
        if not FINGERPRINT.fullmatch(self.quantizer):
            raise CodesFileError(f"quantizer fingerprint {self.quantizer!r} is not 16 lowercase hex digits")
        if self.mode not in MODES:
            shown = self.mode if self.mode.isascii() and self.mode.isprintable() and len(self.mode) <= 16 else "unknown"
            raise CodesFileError(f"the codes file names view mode \"{shown}\"; codes are made in one of "
                                 f"{', '.join(MODES)}")
        for i, codes in enumerate(self.pages):
            if codes.shape != (NUM_CODES,) or int(codes.max(initial=0)) > MAX_LEVEL:
                raise CodesFileError(f"page {i + 1} is not {NUM_CODES} codes in 0..{MAX_LEVEL}")

    def to_bytes(self) -> bytes:
        mode = self.mode.encode("ascii")
        head = HEADER.pack(MAGIC, VERSION, len(mode), PACKED_BYTES, len(self.pages), bytes.fromhex(self.quantizer)) + mode
        pages = [pack(c) for c in self.pages]
        return head + CRC.pack(zlib.crc32(head)) + b"".join(p + CRC.pack(page_checksum(i + 1, p)) for i, p in enumerate(pages))

    @classmethod
    def from_bytes(cls, data: bytes) -> "CodesFile":
        if len(data) < HEADER.size or data[:4] != MAGIC:
            raise CodesFileError(f"not a codes file: it does not start with {MAGIC.decode()} (an {SUFFIX} file "
                                 "written by `ocr-latent encode` or /encode?format=olc)")
        magic, version, mode_len, page_bytes, count, fingerprint = HEADER.unpack_from(data)
        if version not in READABLE:
            raise CodesFileError(f"codes file format version {version}; this reader knows versions "
                                 f"{', '.join(map(str, READABLE))}")
        if page_bytes != PACKED_BYTES:
            raise CodesFileError(f"codes file holds {page_bytes} bytes per page; this service's codes are "
                                 f"{PACKED_BYTES} bytes ({NUM_CODES} codes)")
        checked = version >= 2
        head_end = HEADER.size + mode_len
        start = head_end + (CRC.size if checked else 0)
        stride = page_bytes + (CRC.size if checked else 0)
        if len(data) != start + count * stride:
            raise CodesFileError(f"codes file is {len(data)} bytes; its header promises {count} page(s), which "
                                 f"take {start + count * stride} (truncated or padded?)")
        if checked and CRC.unpack_from(data, head_end)[0] != zlib.crc32(data[:head_end]):
            raise CodesFileError("the codes file's header is damaged: its checksum does not match")
        try:
            mode = data[HEADER.size:head_end].decode("ascii")
        except UnicodeDecodeError:
            raise CodesFileError("codes file's mode name is not ASCII") from None
        pages = []
        for i in range(count):
            packed = data[start + i * stride: start + i * stride + page_bytes]
            if checked and CRC.unpack_from(data, start + i * stride + page_bytes)[0] != page_checksum(i + 1, packed):
                raise CodesFileError(f"page {i + 1} of the codes file is damaged: its checksum does not match "
                                     "(the codes changed after they were written)", page=i + 1)
            pages.append(unpack(packed).astype(np.uint8))
        return cls(fingerprint.hex(), mode, pages)


def raw_codes_file(data: bytes, health) -> CodesFile | None:
    """Bare codes (exactly 2,048 bytes, as `/encode`'s codes_b64 decodes to) as a one-page codes file
    for the server that `health()` describes, or None for anything else. Bare codes name no quantizer,
    so nothing can check that this server's made them: the result says so (quantizer_unchecked)."""
    if len(data) != PACKED_BYTES or data.startswith(MAGIC):
        return None
    info = health()
    return CodesFile(info["quantizer"], info["mode"], [unpack(data).astype(np.uint8)], quantizer_unchecked=True)
