"""architecture.json, read in one place: the pinned base model, the code geometry, the prompts, the
generation rules and the names of the dtypes the service takes."""
from __future__ import annotations

import json
from pathlib import Path

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
