"""architecture.json, read in one place: the pinned base model, the code geometry and the codes' wire
format (packing, the quantizer fingerprint's form), the prompts, the generation rules and the names
of the dtypes the service takes. No torch here: the client side imports it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
ARCHITECTURE = json.loads((ROOT / "architecture.json").read_text())

CODES = ARCHITECTURE["codes"]
NUM_CODES, BITS_PER_CODE, PACKED_BYTES = CODES["num_codes"], CODES["bits_per_code"], CODES["packed_bytes"]
MAX_LEVEL = (1 << BITS_PER_CODE) - 1
assert NUM_CODES * BITS_PER_CODE == 8 * PACKED_BYTES, "architecture.json: codes do not fill packed_bytes"
PROMPTS: dict[str, str] = ARCHITECTURE["prompts"]
GENERATION = ARCHITECTURE["generation"]

# the dtype names DTYPE / PREFILL_DTYPE / --dtype accept, and the torch dtype each means
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}

FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # a quantizer's fingerprint (quantizer.ScalarCodes.fingerprint)


def pack(codes) -> bytes:
    """4096 codes in 0..15 -> 2048 bytes, two codes a byte, the first in the high nibble."""
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if c.size % 2 or c.max(initial=0) > 15:
        raise ValueError("pack needs an even number of codes in 0..15")
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8).tobytes()


def unpack(data: bytes) -> np.ndarray:
    b = np.frombuffer(data, dtype=np.uint8)
    return np.stack([b >> 4, b & 15], axis=1).reshape(-1)
