"""The HTTP API's schemas (pydantic models and the OpenAPI fragments server.py states), apart from the endpoints."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ocr_latent.architecture import BITS_PER_CODE, MAX_LEVEL, NUM_CODES, PACKED_BYTES, PROMPTS
from ocr_latent.architecture import FINGERPRINT

MAX_TOKENS = 8192
PAGES_PATTERN = r"^\s*\d+\s*(-\s*\d*\s*)?(,\s*\d+\s*(-\s*\d*\s*)?)*$"  # documents.parse_pages


def integral(value: Any) -> Any:
    """JSON Schema counts 10.0 as an integer, so the server does too (never True, never "10")."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63 else value


JsonInt = Annotated[StrictInt, BeforeValidator(integral)]


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: StrictStr = Field(description="the image file's bytes as base64, or a data URL "
                                         "(data:image/png;base64,...)")


QUANTIZER_FIELD = Field(description="fingerprint of the quantizer that made the codes (16 hex digits); codes "
                                    "decode correctly only with the same one", pattern=FINGERPRINT.pattern)


FIDELITY_DOC = ("how faithfully these codes carry the page for the decoder, 0..1 (from what of the page's features "
                "the codes lose, calibrated on held-out pages; null where the quantizer has no calibration): below "
                "0.2, keep the original")
CONFIDENCE_DOC = ("how far to trust the text, 0..1 (calibrated on held-out pages: the share of readings at this "
                  "confidence that were faithful, CER <= 0.25; null where the quantizer has no calibration)")


class EncodeResponse(BaseModel):
    """One image's codes."""
    codes: list[int] = Field(description="4096 codes, each 0..15")
    codes_b64: str = Field(description="the codes packed two per byte (first code in the high nibble), "
                                       "2048 bytes, base64")
    num_codes: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    quantizer: str = QUANTIZER_FIELD
    mode: str = Field(description="the view mode the page was encoded in")
    fidelity: float | None = Field(None, description=FIDELITY_DOC)


class PageCodes(BaseModel):
    page: int = Field(description="page number in the document, from 1")
    codes: list[int] = Field(description="4096 codes, each 0..15")
    codes_b64: str = Field(description="the codes packed, 2048 bytes, base64")
    fidelity: float | None = Field(None, description=FIDELITY_DOC)


class EncodePagesResponse(BaseModel):
    """A PDF's codes, one set per page."""
    pages: list[PageCodes]
    num_codes: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    quantizer: str = QUANTIZER_FIELD
    mode: str


MIN_TOKENS_DOC = ("fewest tokens to generate: EOS and the repetition rule cannot end the text sooner (default 0; at most "
                  "max_tokens; without max_tokens, max_tokens is raised to it)")
MIN_CONFIDENCE_DOC = ("the early stop, off by default: a reading whose confidence stays below this after 48 tokens "
                      "ends with finish_reason low_confidence and its text so far (garbage costs no more)")
IGNORE_EOS_DOC = ("generate until max_tokens: EOS is never chosen and the repetition rule never stops (default false; "
                  "for benchmarks of fixed output lengths)")


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the constraints are checked in _one_source (with messages that name the bad entry); the schema states them
    # ints, or floats that are integers (JSON Schema's 10.0), checked in _one_source: a validator per item costs 10x
    codes: list[StrictInt | StrictFloat] | None = Field(None, description=f"{NUM_CODES} ints in 0..{MAX_LEVEL} (exactly one of codes, codes_b64)",
                                          json_schema_extra={"minItems": NUM_CODES, "maxItems": NUM_CODES,
                                                             "items": {"type": "integer", "minimum": 0, "maximum": MAX_LEVEL}})
    codes_b64: StrictStr | None = Field(None, description=f"{PACKED_BYTES} packed bytes as base64, as /encode returns them",
                                        json_schema_extra={"contentEncoding": "base64"})
    prompt: Literal["free", "markdown"] | None = Field(None, description='"free" (the default): <image>\\nFree OCR.; '
                                                       '"markdown": <image>\\n<|grounding|>Convert the document to markdown. '
                                                       "Overrides the query parameter.")
    max_tokens: JsonInt | None = Field(None, ge=1, le=MAX_TOKENS, description="most tokens to generate (EOS "
                                                                            "included; default 4096); overrides the "
                                                                            "query parameter")
    min_tokens: JsonInt | None = Field(None, ge=0, le=MAX_TOKENS, description=MIN_TOKENS_DOC + "; overrides the query "
                                                                                        "parameter")
    ignore_eos: StrictBool | None = Field(None, description=IGNORE_EOS_DOC + "; overrides the query parameter")
    quantizer: StrictStr | None = Field(None, pattern=FINGERPRINT.pattern,
                                        description="the fingerprint /encode returned with these codes: a 409 when it "
                                                    "is not this server's quantizer (instead of wrong text)")
    min_confidence: float | None = Field(None, ge=0, le=1, strict=True, description=MIN_CONFIDENCE_DOC +
                                         "; overrides the query parameter")
    stream: StrictBool = Field(False, description="answer text/event-stream: `delta` events ({text}) as the text "
                                                  "is generated, then one `done` event ({text, num_tokens, "
                                                  "prompt_tokens, finish_reason, confidence}) or `error` event "
                                                  "({error})")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.codes is None) == (self.codes_b64 is None):
            raise ValueError("give exactly one of codes and codes_b64")
        if self.codes is not None:
            if len(self.codes) != NUM_CODES:
                raise ValueError(f"codes has {len(self.codes)} entries; need exactly {NUM_CODES}")
            codes = self.codes  # min/max/set run in C; the loops that name the bad entry only on a bad list
            if min(codes) < 0 or max(codes) > MAX_LEVEL:
                bad = next(i for i, c in enumerate(codes) if not 0 <= c <= MAX_LEVEL)
                raise ValueError(f"codes[{bad}] = {codes[bad]} is out of range 0..{MAX_LEVEL}")
            if float in set(map(type, codes)):  # NaN passes min/max; it is no integer either
                bad = next((i for i, c in enumerate(codes) if type(c) is float and not c.is_integer()), None)
                if bad is not None:
                    raise ValueError(f"codes[{bad}] = {codes[bad]} is not an integer")
        return self

    @model_validator(mode="after")
    def _lengths(self):  # a query parameter's max_tokens is checked against min_tokens by the engine
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}: a decode cannot "
                             f"generate more tokens than max_tokens; raise max_tokens or lower min_tokens")
        return self


class DecodeResponse(BaseModel):
    text: str
    num_tokens: int = Field(description="tokens of the text, the end-of-sequence token not counted; "
                                        "== max_tokens when finish_reason is length")
    finish_reason: Literal["stop", "length", "repetition", "low_confidence"]
    prompt_tokens: int = Field(description="the decoder's input positions: image tokens and prompt")
    confidence: float | None = Field(None, description=CONFIDENCE_DOC)


class PageText(DecodeResponse):
    page: int = Field(description="page number in the codes file, from 1")


class DecodePagesResponse(BaseModel):
    """A codes file's pages, read."""
    pages: list[PageText]
    quantizer: str = QUANTIZER_FIELD


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    revision: str
    codes_per_image: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    device: str
    quantizer: str = QUANTIZER_FIELD
    mode: str = Field(description="the view mode pages are encoded in")


class LoadingResponse(BaseModel):
    status: Literal["loading", "failed"]
    error: dict | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# what the server accepts as codes_b64, stated exactly: 2048 bytes are 2,732 base64 characters, the last
# group two bytes and one '=' (URL-safe letters, wrapping and missing padding are tolerated too)
CODES_B64_PATTERN = f"^[A-Za-z0-9+/]{{{4 * (PACKED_BYTES // 3)}}}[A-Za-z0-9+/]{{2}}[AEIMQUYcgkosw048]=$"


# one server-sent event of a streamed /decode, as OpenAPI 3.1 describes the events of a stream
SSE_EVENT_SCHEMA = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": ["delta", "done", "error"]},
    "data": {"type": "string", "contentMediaType": "application/json", "description":
             'delta: {"text": the next piece of text}; done (last): {"text", "num_tokens", "prompt_tokens", '
             '"finish_reason", "confidence"}; error (last): {"error": {"type", "message"}}'}}}


def decode_request_schema(quantizer: str | None = None, prompts: list[str] | None = None) -> dict:
    """DecodeRequest's JSON schema with every constraint the server enforces: exactly one of codes and
    codes_b64 (neither nullable), and, once a model is loaded, its quantizer and prompts."""
    schema = DecodeRequest.model_json_schema()
    props = schema["properties"]
    props["codes"] = {"type": "array", "minItems": NUM_CODES, "maxItems": NUM_CODES,
                      "items": {"type": "integer", "minimum": 0, "maximum": MAX_LEVEL},
                      "description": props["codes"]["description"]}
    props["codes_b64"] = {"type": "string", "pattern": CODES_B64_PATTERN, "contentEncoding": "base64",
                          "description": props["codes_b64"]["description"]}
    props["prompt"] = {"type": "string", "enum": prompts or list(PROMPTS), "default": "free",
                       "description": props["prompt"]["description"]}
    props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS, "default": 4096,
                           "description": props["max_tokens"]["description"]}
    props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS, "default": 0,
                           "description": props["min_tokens"]["description"]}
    props["ignore_eos"] = {"type": "boolean", "default": False, "description": props["ignore_eos"]["description"]}
    props["quantizer"] = {"type": "string", "pattern": FINGERPRINT.pattern, "description": props["quantizer"]["description"],
                          **({"enum": [quantizer]} if quantizer else {})}
    schema["oneOf"] = [{"required": ["codes"]}, {"required": ["codes_b64"]}]
    return schema
