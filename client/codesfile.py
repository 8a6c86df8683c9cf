"""The wire format of codes: 4096 codes packed into 2048 bytes, and the `.olc` codes file, pages of
codes that say which quantizer made them (no torch here: the client and CLI import this).

    offset  size  field
    0       4     magic b"OLC1"
    4       1     format version (1)
    5       1     n = length of the mode name
    6       2     bytes per page (2048: 4096 four-bit codes, two a byte, the first in the high nibble)
    8       4     page count
    12      8     quantizer fingerprint (16 hex digits as 8 bytes; quantizer.ScalarCodes.fingerprint)
    20      n     mode name, ASCII (the view mode the pages were encoded in: "base", ...)
    20+n    2048 per page, in page order

Integers are little-endian. The file is exactly 20 + n + pages * 2048 bytes. Codes decoded by any
quantizer but the one that made them give wrong text without any error, so a reader compares the
fingerprint before decoding (the server answers 409 on a mismatch). docs/codes-file.md has the same.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

from ocr_latent.architecture import MAX_LEVEL, NUM_CODES, PACKED_BYTES

MAGIC = b"OLC1"
VERSION = 1
MEDIA_TYPE = "application/vnd.ocr-latent.codes"
SUFFIX = ".olc"
HEADER = struct.Struct("<4sBBHI8s")
FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def pack(codes) -> bytes:
    """4096 codes in 0..15 -> 2048 bytes, two codes a byte, the first in the high nibble."""
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if c.size % 2 or c.max(initial=0) > 15:
        raise ValueError("pack needs an even number of codes in 0..15")
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8).tobytes()


def unpack(data: bytes) -> np.ndarray:
    b = np.frombuffer(data, dtype=np.uint8)
    return np.stack([b >> 4, b & 15], axis=1).reshape(-1)


class CodesFileError(ValueError):
    """Bytes that are not a codes file this version can read; the message says what is wrong."""


@dataclass
class CodesFile:
    quantizer: str  # the fingerprint, 16 hex digits
    mode: str
    pages: list[np.ndarray]  # each NUM_CODES uint8 codes in 0..MAX_LEVEL

    def __post_init__(self):
        if not FINGERPRINT.fullmatch(self.quantizer):
            raise CodesFileError(f"quantizer fingerprint {self.quantizer!r} is not 16 lowercase hex digits")
        if not self.mode.isascii() or not 0 < len(self.mode) < 256:
            raise CodesFileError(f"mode {self.mode!r} is not a short ASCII name")
        for i, codes in enumerate(self.pages):
            if codes.shape != (NUM_CODES,) or int(codes.max(initial=0)) > MAX_LEVEL:
                raise CodesFileError(f"page {i + 1} is not {NUM_CODES} codes in 0..{MAX_LEVEL}")

    def to_bytes(self) -> bytes:
        mode = self.mode.encode("ascii")
        head = HEADER.pack(MAGIC, VERSION, len(mode), PACKED_BYTES, len(self.pages), bytes.fromhex(self.quantizer))
        return head + mode + b"".join(pack(c) for c in self.pages)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CodesFile":
        if len(data) < HEADER.size or data[:4] != MAGIC:
            raise CodesFileError(f"not a codes file: it does not start with {MAGIC.decode()} (an {SUFFIX} file "
                                 "written by `ocr-latent encode` or /encode?format=olc)")
        magic, version, mode_len, page_bytes, count, fingerprint = HEADER.unpack_from(data)
        if version != VERSION:
            raise CodesFileError(f"codes file format version {version}; this reader knows version {VERSION}")
        if page_bytes != PACKED_BYTES:
            raise CodesFileError(f"codes file holds {page_bytes} bytes per page; this service's codes are "
                                 f"{PACKED_BYTES} bytes ({NUM_CODES} codes)")
        start = HEADER.size + mode_len
        if len(data) != start + count * page_bytes:
            raise CodesFileError(f"codes file is {len(data)} bytes; its header promises {count} page(s), which "
                                 f"take {start + count * page_bytes} (truncated or padded?)")
        try:
            mode = data[HEADER.size:start].decode("ascii")
        except UnicodeDecodeError:
            raise CodesFileError("codes file's mode name is not ASCII") from None
        pages = [unpack(data[start + i * page_bytes: start + (i + 1) * page_bytes]).astype(np.uint8)
                 for i in range(count)]
        return cls(fingerprint.hex(), mode, pages)
