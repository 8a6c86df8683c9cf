"""The codes file detects damage: checksums over the header and every page (version 2), version 1
files still read, modes checked, bare 2,048-byte codes taken only for what they are."""
import struct
import zlib

import numpy as np
import pytest

from ocr_latent.client.codesfile import HEADER, CodesFile, CodesFileError, pack, raw_codes_file

FINGERPRINT = "0123456789abcdef"


def random_file(pages: int = 2, seed: int = 0) -> CodesFile:
    rng = np.random.default_rng(seed)
    return CodesFile(FINGERPRINT, "base", [rng.integers(0, 16, 4096, dtype=np.uint8) for _ in range(pages)])


def version_1(doc: CodesFile) -> bytes:
    """A file as this project wrote them before checksums (format version 1)."""
    head = HEADER.pack(b"OLC1", 1, 4, 2048, len(doc.pages), bytes.fromhex(doc.quantizer)) + b"base"
    return head + b"".join(pack(p) for p in doc.pages)


def test_version_2_layout_round_trips_with_a_checksum_for_the_header_and_each_page():
    doc = random_file(3)
    data = doc.to_bytes()
    assert data[4] == 2 and len(data) == 24 + len("base") + 3 * (2048 + 4)
    assert struct.unpack_from("<I", data, 24)[0] == zlib.crc32(data[:24])
    first = data[28:28 + 2048]
    assert first == pack(doc.pages[0])
    assert struct.unpack_from("<I", data, 28 + 2048)[0] == zlib.crc32(first, zlib.crc32(struct.pack("<I", 1)))
    back = CodesFile.from_bytes(data)
    assert back.quantizer == FINGERPRINT and back.mode == "base" and not back.quantizer_unchecked
    assert all(np.array_equal(a, b) for a, b in zip(back.pages, doc.pages))


def test_version_1_files_still_read():
    doc = random_file(2, seed=1)
    back = CodesFile.from_bytes(version_1(doc))
    assert back.quantizer == FINGERPRINT and all(np.array_equal(a, b) for a, b in zip(back.pages, doc.pages))


@pytest.mark.parametrize("page", [1, 2, 3])
def test_one_flipped_bit_in_a_page_is_refused_naming_that_page(page):
    data = bytearray(random_file(3).to_bytes())
    data[28 + (page - 1) * 2052 + 777] ^= 0x10
    with pytest.raises(CodesFileError, match=f"page {page} of the codes file is damaged") as e:
        CodesFile.from_bytes(bytes(data))
    assert e.value.page == page


def test_a_damaged_checksum_a_damaged_header_and_swapped_pages_are_refused():
    data = random_file(2).to_bytes()
    flipped_sum = data[:28 + 2048] + bytes([data[28 + 2048] ^ 1]) + data[28 + 2049:]
    with pytest.raises(CodesFileError, match="page 1 .* damaged"):
        CodesFile.from_bytes(flipped_sum)
    other_quantizer = data[:12] + bytes([data[12] ^ 1]) + data[13:]
    with pytest.raises(CodesFileError, match="header is damaged"):
        CodesFile.from_bytes(other_quantizer)
    swapped = data[:28] + data[28 + 2052:] + data[28:28 + 2052]
    with pytest.raises(CodesFileError, match="page 1 .* damaged"):
        CodesFile.from_bytes(swapped)


@pytest.mark.parametrize("mode", ["tiny\x00", "../etc", "x" * 255, "BASE", ""])
def test_unknown_modes_are_refused_without_echoing_them(mode):
    raw = mode.encode()
    head = HEADER.pack(b"OLC1", 1, len(raw), 2048, 1, bytes.fromhex(FINGERPRINT)) + raw
    with pytest.raises(CodesFileError, match="codes are made in one of tiny, small, base, large") as e:
        CodesFile.from_bytes(head + bytes(2048))
    assert "\\x00" not in str(e.value) and "x" * 20 not in str(e.value)


def test_bare_codes_become_a_file_for_the_server_that_reads_them_marked_unchecked():
    codes = random_file(1).pages[0]
    asked = []
    health = lambda: asked.append(1) or {"quantizer": "fedcba9876543210", "mode": "base"}
    doc = raw_codes_file(pack(codes), health)
    assert doc.quantizer == "fedcba9876543210" and doc.quantizer_unchecked and np.array_equal(doc.pages[0], codes)
    assert raw_codes_file(random_file(1).to_bytes(), health) is None  # a codes file is read as one
    assert raw_codes_file(pack(codes)[:-1], health) is None and len(asked) == 1  # nor anything else
