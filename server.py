"""ocr-latent HTTP service: page image -> 4096 four-bit codes (/encode), codes -> page text (/decode).

The HTTP face of `engine.Engine`: pydantic schemas, input parsing (JSON, multipart, raw bytes;
base64; images), the mapping of engine errors to HTTP statuses, Prometheus metrics and the app
factory. The event loop only parses, validates and routes requests; the engine's thread runs the
model and resolves each job's future.

Run with `./serve.sh` (or `python server.py`, or `uvicorn --factory server:create_app`);
configuration is by environment variable, see `Settings`, `engine.EngineConfig` and README.md.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import copy
import hmac
import io
import json
import logging
import os
import re
import sys
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, model_validator
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from ocr_latent.architecture import BITS_PER_CODE, MAX_LEVEL, NUM_CODES, PACKED_BYTES, PROMPTS
from ocr_latent.client.codesfile import FINGERPRINT, MEDIA_TYPE as CODES_MEDIA_TYPE, CodesFile, CodesFileError, pack, unpack
from ocr_latent.serving.documents import DocumentError, looks_like_pdf, render_pdf
from ocr_latent.serving.engine import (Cancelled, DeadlineExceeded, DecodeResult, Engine, EngineConfig, EngineError, Job,
                    Loading, Overloaded, Unavailable, env_number, env_text)
from ocr_latent.serving.telemetry import Metrics

log = logging.getLogger("ocr_latent.server")

# what /encode decodes (spec: PNG, JPEG, WebP, TIFF, BMP; MPO is how Pillow opens multi-picture camera
# JPEGs). Formats outside this list (EPS, which shells out to Ghostscript, PSD, ICO, ...) are a 415.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "TIFF", "BMP")
ENDPOINTS = ("/health", "/encode", "/decode", "/metrics")
MAX_TOKENS = 8192
PAGES_PATTERN = r"^\s*\d+\s*(-\s*\d*\s*)?(,\s*\d+\s*(-\s*\d*\s*)?)*$"  # documents.parse_pages


# ----------------------------------------------------------------------------- configuration
@dataclass
class Settings:
    """The HTTP side's settings; the engine's are in `engine` (both read from the environment)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_body_bytes: int = 20_000_000  # MAX_BODY_BYTES -> 413
    max_image_pixels: int = 40_000_000  # MAX_IMAGE_PIXELS -> 413
    header_timeout_s: float = 10.0  # HEADER_TIMEOUT_S: a connection must send a whole request head within this
    max_connections: int = 1000  # MAX_CONNECTIONS: beyond this many open connections, requests get a 503
    api_key: str | None = None  # API_KEY or API_KEY_FILE: bearer token required on /encode, /decode, /metrics
    max_pages: int = 32  # MAX_PAGES: pages of a PDF encoded, or of a codes file decoded, per request -> 413

    @classmethod
    def from_env(cls) -> "Settings":
        api_key = env_text("API_KEY")
        if api_key is None and (key_file := env_text("API_KEY_FILE")):
            try:
                api_key = open(key_file).read().strip() or None
            except OSError as e:
                raise SystemExit(f"API_KEY_FILE={key_file!r}: {e}") from None
            if api_key is None:
                raise SystemExit(f"API_KEY_FILE={key_file!r} is empty")
        return cls(engine=EngineConfig.from_env(), max_body_bytes=env_number("MAX_BODY_BYTES", 20_000_000, int, 1),
                   max_image_pixels=env_number("MAX_IMAGE_PIXELS", 40_000_000, int, 1),
                   header_timeout_s=env_number("HEADER_TIMEOUT_S", 10.0, float, 0.1),
                   max_connections=env_number("MAX_CONNECTIONS", 1000, int, 1), api_key=api_key,
                   max_pages=env_number("MAX_PAGES", 32, int, 1))


# ----------------------------------------------------------------------------- API models
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


class EncodeResponse(BaseModel):
    """One image's codes."""
    codes: list[int] = Field(description="4096 codes, each 0..15")
    codes_b64: str = Field(description="the codes packed two per byte (first code in the high nibble), "
                                       "2048 bytes, base64")
    num_codes: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    quantizer: str = QUANTIZER_FIELD
    mode: str = Field(description="the view mode the page was encoded in")


class PageCodes(BaseModel):
    page: int = Field(description="page number in the document, from 1")
    codes: list[int] = Field(description="4096 codes, each 0..15")
    codes_b64: str = Field(description="the codes packed, 2048 bytes, base64")


class EncodePagesResponse(BaseModel):
    """A PDF's codes, one set per page."""
    pages: list[PageCodes]
    num_codes: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    quantizer: str = QUANTIZER_FIELD
    mode: str


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
    quantizer: StrictStr | None = Field(None, pattern=FINGERPRINT.pattern,
                                        description="the fingerprint /encode returned with these codes: a 409 when it "
                                                    "is not this server's quantizer (instead of wrong text)")
    stream: StrictBool = Field(False, description="answer text/event-stream: `delta` events ({text}) as the text "
                                                  "is generated, then one `done` event ({text, num_tokens, "
                                                  "prompt_tokens, finish_reason}) or `error` event ({error})")

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


class DecodeResponse(BaseModel):
    text: str
    num_tokens: int = Field(description="tokens of the text, the end-of-sequence token not counted; "
                                        "== max_tokens when finish_reason is length")
    finish_reason: Literal["stop", "length", "repetition"]
    prompt_tokens: int = Field(description="the decoder's input positions: image tokens and prompt")


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
             '"finish_reason"}; error (last): {"error": {"type", "message"}}'}}}


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
    props["quantizer"] = {"type": "string", "pattern": FINGERPRINT.pattern, "description": props["quantizer"]["description"],
                          **({"enum": [quantizer]} if quantizer else {})}
    schema["oneOf"] = [{"required": ["codes"]}, {"required": ["codes_b64"]}]
    return schema


# ----------------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers or {}


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client hung up while its jobs ran (they are cancelled)."""


def error_response(status: int, type: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=headers)


HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 406: "not_acceptable",
                    413: "payload_too_large",
                    415: "unsupported_media_type", 422: "invalid_request", 503: "unavailable"}


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts[:5]) + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")


# ----------------------------------------------------------------------------- input parsing
def b64decode(text: str, what: str) -> bytes:
    """Standard or URL-safe base64; whitespace (e.g. `base64`'s line wrapping) and missing padding are
    tolerated, anything else is a 400."""
    s = "".join(text.split())
    if "-" in s or "_" in s:
        s = s.replace("-", "+").replace("_", "/")
    s += "=" * (-len(s) % 4)
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, "invalid_base64", f"{what} is not valid base64: {e}") from None


def image_bytes_from_string(value: str) -> bytes:
    if value.startswith("data:"):
        header, sep, payload = value.partition(",")
        if not sep:
            raise ApiError(400, "invalid_base64", "image data URL has no ',' before its data")
        if not header.lower().endswith(";base64"):
            raise ApiError(400, "invalid_base64", "image data URL must be base64 (data:image/png;base64,...)")
        value = payload
    data = b64decode(value, "image")
    if not data:
        raise ApiError(415, "unsupported_media_type", "image is empty")
    return data


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image (EXIF orientation applied). The pixel count is checked from the header
    before the pixels are decoded: 413 over `max_pixels`, 415 for anything that is not a
    supported image (any decoder failure on bad bytes is the client's fault, never a 5xx)."""
    from ocr_latent.encoder import load_image
    Image.init()
    try:
        image = Image.open(io.BytesIO(data), formats=[f for f in IMAGE_FORMATS if f in Image.OPEN])
    except Image.DecompressionBombError as e:
        raise ApiError(413, "image_too_large", f"image too large: {e}") from None
    except Exception as e:  # noqa: BLE001 - UnidentifiedImageError, or a plugin choking on bad bytes
        raise ApiError(415, "unsupported_media_type",
                       f"not a supported image ({', '.join(IMAGE_FORMATS)}): {e}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ApiError(413, "image_too_large", f"image is {width}x{height} = {width * height} pixels; the limit "
                                               f"is {max_pixels} (MAX_IMAGE_PIXELS)")
    if width < 1 or height < 1:
        raise ApiError(415, "unsupported_media_type", f"image has no pixels ({width}x{height})")
    try:
        image.load()
        return load_image(image)
    except Image.DecompressionBombError as e:
        raise ApiError(413, "image_too_large", f"image too large: {e}") from None
    except MemoryError:
        raise ApiError(413, "image_too_large", "image too large to decode") from None
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data
        raise ApiError(415, "unsupported_media_type", f"could not decode the image: {e}") from None


# ----------------------------------------------------------------------------- engine errors -> HTTP
def http_error(e: EngineError) -> ApiError:
    headers = {"Retry-After": str(int(e.retry_after_s))} if e.retry_after_s is not None else {}
    if isinstance(e, Overloaded):
        return ApiError(503, "overloaded", e.message, headers)
    if isinstance(e, Unavailable):
        return ApiError(503, "loading" if isinstance(e, Loading) else "unavailable", e.message, headers)
    if isinstance(e, DeadlineExceeded):
        return ApiError(504, "timeout", e.message)
    if isinstance(e, Cancelled):
        return ApiError(499, "client_closed_request", e.message)
    return ApiError(500, "internal", e.message)


# ----------------------------------------------------------------------------- ASGI guard
# the request being answered, for every log line written while answering it (X-Request-ID)
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "request_id": getattr(record, "request_id", "-"), "message": record.getMessage()}
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out)


PROTECTED = ("/encode", "/decode", "/metrics")  # with API_KEY set; /health stays open for probes


def authorized(scope, api_key: str) -> bool:
    """`Authorization: Bearer <API_KEY>`, compared in constant time."""
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class Guard:
    """Outermost middleware: the request id (the client's X-Request-ID when well-formed, else a new one;
    returned on the response, in every log line), the API key (401 before anything is read), the body-size
    limit (413 from Content-Length before reading, or as soon as a streamed body passes it) and metrics."""

    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app, self.s, self.m = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        t0, state = time.perf_counter(), {"status": 500, "started": False}

        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id.set(rid)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        limit = self.s.max_body_bytes
        too_large = error_response(413, "payload_too_large",
                                   f"request body is larger than {limit} bytes (MAX_BODY_BYTES)")
        try:
            if self.s.api_key and scope["path"].rstrip("/") in PROTECTED and not authorized(scope, self.s.api_key):
                await error_response(401, "unauthorized", "send the API key as 'Authorization: Bearer <key>' (API_KEY)",
                                     {"WWW-Authenticate": "Bearer"})(scope, receive, send_wrapper)
                return
            length = dict(scope["headers"]).get(b"content-length")
            try:
                declared = int(length) if length is not None else None
            except ValueError:
                declared = None
            if declared is not None and declared > limit:
                await too_large(scope, receive, send_wrapper)
                return
            received = 0

            async def receive_wrapper():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge()
                return message

            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except BodyTooLarge:
                if not state["started"]:
                    await too_large(scope, receive, send_wrapper)
        finally:
            self.m.requests.labels(endpoint, str(state["status"])).inc()
            self.m.latency.labels(endpoint).observe(time.perf_counter() - t0)
            request_id.reset(token)


# ----------------------------------------------------------------------------- the app
_fatal_hook = None  # set by main(): ends uvicorn with a non-zero exit status


def _default_fatal(message: str) -> None:
    """Outside main() (e.g. `uvicorn --factory server:create_app`): a server without a model must not linger."""
    if _fatal_hook is not None:
        _fatal_hook(message)
        return
    sys.stderr.flush()
    os._exit(1)


def create_app(settings: Settings | None = None, engine_factory: Callable[..., Engine] | None = None) -> FastAPI:
    """`engine_factory(config, metrics, on_fatal)` makes the engine the endpoints use (default: `Engine`, in
    this process); ray_serve.py passes one whose jobs run on Ray Serve replicas."""
    s = settings or Settings.from_env()
    metrics = Metrics()
    Image.MAX_IMAGE_PIXELS = s.max_image_pixels  # Pillow's own bomb check; above 2x it raises at open
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we reject those sizes ourselves

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = (engine_factory or Engine)(s.engine, metrics, _default_fatal).start()
        app.state.engine = engine
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    errors = {code: {"model": ErrorResponse} for code in (400, 401, 413, 415, 422, 503, 504)}
    # redirect_slashes off: "/decode/" is a 404, not a redirect built from the client's Host header
    app = FastAPI(title="ocr-latent", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="Document image -> 4096 four-bit codes -> page text (DeepSeek-OCR architecture).")
    app.state.settings, app.state.metrics = s, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return error_response(400, "invalid_json", "request body is not valid JSON")
        return error_response(422, "invalid_request", validation_message(exc))

    @app.exception_handler(ClientDisconnect)  # during the upload
    @app.exception_handler(ClientGone)  # while its jobs ran
    async def _client_gone(request: Request, exc: Exception):
        # nobody reads this answer; it is what /metrics counts (499, not a server error)
        return error_response(499, "client_closed_request", "the client disconnected")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, HTTP_ERROR_TYPES.get(exc.status_code, "error"), str(exc.detail),
                              getattr(exc, "headers", None))

    tracebacks_logged: dict[str, float] = {}

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # a bug hit by every request must not flood the log: one traceback per kind of error a minute
        key, now = f"{type(exc).__name__}: {exc}"[:200], time.monotonic()
        if now - tracebacks_logged.get(key, -60.0) >= 60.0:
            tracebacks_logged[key] = now
            log.error("unhandled error:\n%s", "".join(traceback.format_exception(exc)))
        else:
            log.error("unhandled error (traceback logged within the last minute): %s", key)
        return error_response(500, "internal", f"internal error: {type(exc).__name__}")

    def engine_of(request: Request) -> Engine:
        """The engine, once ready (checked before the body is read: a loading server answers at once)."""
        engine: Engine = request.app.state.engine
        try:
            engine.check_ready()
        except EngineError as e:
            raise http_error(e) from None
        return engine

    async def run_jobs(request: Request, engine: Engine, submits: list[Callable[[], Job]]) -> list[Any]:
        """Submit jobs (each `submit` one of the engine's submitting calls) and wait for all of them, for
        the client (a hang-up cancels them) and for their deadline. One refused job refuses the request."""
        jobs: list[Job] = []
        try:
            for submit in submits:
                jobs.append(submit())
        except (EngineError, ValueError) as e:
            for job in jobs:
                engine.cancel(job)
            if isinstance(e, EngineError):
                raise http_error(e) from None
            raise ApiError(422, "invalid_request", str(e)) from None  # e.g. a prompt the model cannot spell
        results = [asyncio.wrap_future(job.future) for job in jobs]
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            pending, deadline = set(results), max(job.deadline for job in jobs)
            while pending and not gone.done():
                done, pending = await asyncio.wait(pending | {gone}, timeout=max(0.0, deadline - time.monotonic()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                pending.discard(gone)
                if not done or any(f is not gone and f.exception() is not None for f in done):
                    break  # timed out, or one failed: the request fails as a whole
        finally:
            gone.cancel()
            for job, result in zip(jobs, results):
                if not result.done():  # timed out, client gone, a sibling failed, or this task cancelled
                    engine.cancel(job)
                    result.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        for result in results:
            if result.done() and result.exception() is not None:
                e = result.exception()
                raise http_error(e) if isinstance(e, EngineError) else e
        if all(r.done() for r in results):
            return [r.result() for r in results]
        if gone.done():
            raise ClientGone()
        raise http_error(engine.deadline_error())

    def default_max_tokens(engine: Engine, prompt: str) -> int:
        """4096, or what a cache slot holds beyond the prompt when that is less (KV_CACHE_TOKENS)."""
        most = engine.max_new_tokens(prompt) if hasattr(engine, "max_new_tokens") and prompt in engine.prompts else None
        return 4096 if most is None else max(1, min(4096, most))

    def check_quantizer(engine: Engine, fingerprint: str | None) -> None:
        own = engine.pipeline.quantizer_fingerprint
        if fingerprint is not None and fingerprint != own:
            raise ApiError(409, "quantizer_mismatch",
                           f"these codes were made by quantizer {fingerprint}; this server decodes codes of quantizer "
                           f"{own} and would read other codes as wrong text: decode them on the server that made them "
                           f"(or encode the page again here)")

    # ------------------------------------------------------------------ endpoints
    health_answers = {503: {"model": LoadingResponse, "description": "loading (or failed to load)"}}

    @app.head("/health", response_model=HealthResponse, responses=health_answers, operation_id="health_head")
    @app.get("/health", response_model=HealthResponse, responses=health_answers, operation_id="health")
    async def health(request: Request):  # HEAD too: load balancers use it
        engine: Engine = request.app.state.engine
        if engine.ready:
            p = engine.pipeline
            return HealthResponse(status="ok", model=p.label, revision=p.revision, device=p.device,
                                  quantizer=p.quantizer_fingerprint, mode=p.mode)
        if engine.failed:
            return JSONResponse({"status": "failed", "error": {"type": "startup_failed",
                                                               "message": engine.failed.splitlines()[0]}},
                                status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503,
                            headers={"Retry-After": str(s.engine.loading_retry_after_s)})

    binary = {"schema": {"type": "string", "format": "binary"}}
    encode_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": EncodeRequest.model_json_schema()},
        "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "binary", "description": "the image or PDF file"}}}},
        **{t: binary for t in ("image/png", "image/jpeg", "image/webp", "image/tiff", "image/bmp", "application/pdf",
                               "application/octet-stream")}}}}
    encode_answers = {**errors, 200: {"content": {CODES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                                      "description": "JSON; or with format=olc (or that Accept), a codes file"}}

    @app.post("/encode", response_model=EncodeResponse | EncodePagesResponse, responses=encode_answers,
              openapi_extra=encode_body)
    async def encode(request: Request,
                     format: Literal["json", "olc"] | None = Query(None, description=(
                         "json: codes in JSON (the default); olc: a codes file (docs/codes-file.md), as the Accept "
                         f"header {CODES_MEDIA_TYPE} also asks")),
                     pages: str | None = Query(None, max_length=200, pattern=PAGES_PATTERN, description=(
                         "PDFs only: the pages to encode, 1-based, e.g. 1-3,5 or 2- (default all, at most MAX_PAGES)"))):
        """A page image -> 4096 codes; a PDF -> 4096 codes per page. The image or PDF comes as JSON
        {"image": base64 or data URL}, as multipart field `image`, or as the raw bytes with their
        Content-Type. The answer names the quantizer that made the codes."""
        engine = engine_of(request)
        as_file = format == "olc" or format is None and CODES_MEDIA_TYPE in request.headers.get("accept", "")
        data = await read_image_bytes(request, s)
        p, is_pdf = engine.pipeline, looks_like_pdf(data)
        if is_pdf:
            try:
                rendered = await asyncio.to_thread(render_pdf, data, p.mode, pages, s.max_pages)
            except DocumentError as e:
                raise ApiError(e.status, "payload_too_large" if e.status == 413 else
                               "unsupported_media_type" if e.status == 415 else "invalid_document", str(e)) from None
            numbers, images = [n for n, _ in rendered], [im for _, im in rendered]
        else:
            if pages is not None:
                raise ApiError(422, "invalid_request", "pages= selects pages of a PDF; this is a single image")
            numbers, images = [1], [await asyncio.to_thread(open_image, data, s.max_image_pixels)]
        codes = await run_jobs(request, engine, [lambda im=im: engine.encode(im) for im in images])
        if as_file:
            return Response(CodesFile(p.quantizer_fingerprint, p.mode, codes).to_bytes(), media_type=CODES_MEDIA_TYPE)
        packed = [base64.b64encode(pack(c)).decode() for c in codes]
        if is_pdf:
            return EncodePagesResponse(pages=[PageCodes(page=n, codes=c.tolist(), codes_b64=b)
                                              for n, c, b in zip(numbers, codes, packed)],
                                       quantizer=p.quantizer_fingerprint, mode=p.mode)
        return EncodeResponse(codes=codes[0].tolist(), codes_b64=packed[0], quantizer=p.quantizer_fingerprint, mode=p.mode)

    decode_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": decode_request_schema()},
        CODES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary",
                                      "description": "a codes file (docs/codes-file.md), as /encode?format=olc returns"}}}}}
    decode_answers = {**errors, 409: {"model": ErrorResponse, "description": "codes of another quantizer"},
                      200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                            "description": "JSON; with stream=true, server-sent events"}}

    @app.post("/decode", response_model=DecodeResponse | DecodePagesResponse, responses=decode_answers,
              openapi_extra=decode_body)
    async def decode(request: Request,
                     prompt: Literal["free", "markdown"] = Query("free", description="as the JSON field prompt"),
                     max_tokens: int | None = Query(None, ge=1, le=MAX_TOKENS, description="as the JSON field max_tokens")):
        """Codes -> the page's text, greedy. JSON with `codes` or `codes_b64` (one page; `stream` for
        server-sent events), or a codes file as the raw body (every page; refused with a 409 when another
        quantizer made it)."""
        engine = engine_of(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in (CODES_MEDIA_TYPE, "application/octet-stream"):
            return await decode_file(request, engine, await request.body(), prompt, max_tokens or default_max_tokens(engine, prompt))
        body = await read_json(request)
        try:
            req = DecodeRequest.model_validate(body)
        except ValidationError as e:
            raise ApiError(422, "invalid_request", validation_message(e)) from None
        check_quantizer(engine, req.quantizer)
        if req.codes is not None:
            codes = np.asarray(req.codes, dtype=np.uint8)
        else:
            raw = b64decode(req.codes_b64, "codes_b64")
            if len(raw) != PACKED_BYTES:
                raise ApiError(422, "invalid_request", f"codes_b64 holds {len(raw)} bytes = {2 * len(raw)} codes; "
                                                       f"need exactly {PACKED_BYTES} bytes ({NUM_CODES} codes)")
            codes = unpack(raw).astype(np.uint8)
        prompt = req.prompt or prompt
        max_tokens = req.max_tokens or max_tokens or default_max_tokens(engine, prompt)
        if req.stream:
            return stream_decode(request, engine, codes, prompt, max_tokens)
        [result] = await run_jobs(request, engine, [lambda: engine.decode(codes, prompt, max_tokens)])
        return DecodeResponse(text=result.text, num_tokens=result.num_tokens, finish_reason=result.finish_reason,
                              prompt_tokens=result.prompt_tokens)

    async def decode_file(request: Request, engine: Engine, data: bytes, prompt: str, max_tokens: int):
        try:
            doc = CodesFile.from_bytes(data)
        except CodesFileError as e:
            raise ApiError(422, "invalid_codes_file", str(e)) from None
        check_quantizer(engine, doc.quantizer)
        if not doc.pages:
            raise ApiError(422, "invalid_codes_file", "the codes file holds no pages")
        if len(doc.pages) > s.max_pages:
            raise ApiError(413, "payload_too_large", f"the codes file holds {len(doc.pages)} pages; at most "
                                                     f"{s.max_pages} per request (MAX_PAGES)")
        results = await run_jobs(request, engine, [lambda c=c: engine.decode(c, prompt, max_tokens) for c in doc.pages])
        return DecodePagesResponse(quantizer=doc.quantizer, pages=[
            PageText(page=i + 1, text=r.text, num_tokens=r.num_tokens, finish_reason=r.finish_reason,
                     prompt_tokens=r.prompt_tokens) for i, r in enumerate(results)])

    def stream_decode(request: Request, engine: Engine, codes: np.ndarray, prompt: str, max_tokens: int):
        """Server-sent events: `delta` {text} as the text grows, then `done` {text, num_tokens, prompt_tokens,
        finish_reason} or `error` {error}. A client that leaves cancels the job."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        try:
            job = engine.decode(codes, prompt, max_tokens, on_text=lambda piece: loop.call_soon_threadsafe(
                pieces.put_nowait, piece))
        except EngineError as e:
            raise http_error(e) from None
        except ValueError as e:
            raise ApiError(422, "invalid_request", str(e)) from None

        def event(name: str, data: dict) -> bytes:
            return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

        async def events():
            result = asyncio.wrap_future(job.future)
            try:
                while not result.done():
                    piece = asyncio.ensure_future(pieces.get())
                    done, _ = await asyncio.wait({piece, result}, timeout=max(0.0, job.deadline - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if piece in done:
                        yield event("delta", {"text": piece.result()})
                    else:
                        piece.cancel()
                        if not done:
                            raise http_error(engine.deadline_error())
                while not pieces.empty():  # the last pieces are queued before the result is set
                    yield event("delta", {"text": pieces.get_nowait()})
                r: DecodeResult = result.result()
                yield event("done", {"text": r.text, "num_tokens": r.num_tokens, "prompt_tokens": r.prompt_tokens,
                                     "finish_reason": r.finish_reason})
            except (EngineError, ApiError) as e:
                err = http_error(e) if isinstance(e, EngineError) else e
                yield event("error", {"error": {"type": err.type, "message": err.message}})
            finally:
                if not job.future.done():  # the client left (or this server is stopping)
                    engine.cancel(job)
                result.add_done_callback(lambda f: f.cancelled() or f.exception())

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    static_openapi = app.openapi  # FastAPI's, cached

    def openapi() -> dict:
        """The schema, with what the loaded model decides once it is ready: the quantizer whose codes
        /decode takes and the prompts its tokenizer can spell (else those are refused while schema-valid)."""
        engine = getattr(app.state, "engine", None)
        if engine is None or not engine.ready:
            return static_openapi()
        live = copy.deepcopy(static_openapi())
        p = engine.pipeline
        decode_op = live["paths"]["/decode"]["post"]
        decode_op["requestBody"]["content"]["application/json"]["schema"] = decode_request_schema(
            p.quantizer_fingerprint, sorted(p.prompts))
        most = min(engine.max_new_tokens(name) for name in p.prompts) if hasattr(engine, "max_new_tokens") else None
        for param in decode_op["parameters"]:
            if param["name"] == "prompt":
                param["schema"]["enum"] = sorted(p.prompts)
            if param["name"] == "max_tokens" and most is not None:
                param["schema"]["anyOf"][0]["maximum"] = min(MAX_TOKENS, most)
        if most is not None:
            decode_op["requestBody"]["content"]["application/json"]["schema"]["properties"]["max_tokens"]["maximum"] = \
                min(MAX_TOKENS, most)
        return live

    app.openapi = openapi
    app.add_middleware(Guard, settings=s, metrics=metrics)
    return app


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def parse_json(body: bytes) -> Any:
    """Bytes -> JSON, every failure a 400 (the parser recurses per nesting level, and int() refuses
    more than 4,300 digits)."""
    if not body.strip():
        raise ApiError(400, "invalid_json", "request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, "invalid_json", "request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a number with too many digits
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {e}") from None


async def read_json(request: Request) -> Any:
    """The body parsed off the event loop: a large body must not stall /health."""
    return await asyncio.to_thread(parse_json, await request.body())


async def read_image_bytes(request: Request, s: Settings) -> bytes:
    """The image's (or PDF's) bytes, whichever way they came: multipart, raw, or base64 in JSON."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        async with request.form(max_files=4, max_fields=16, max_part_size=s.max_body_bytes) as form:
            item = form.get("image")
            if item is None:
                raise ApiError(422, "invalid_request", "multipart body has no field named 'image'")
            if isinstance(item, UploadFile):
                data = await item.read()
                if not data:
                    raise ApiError(415, "unsupported_media_type", "image file is empty")
                return data
            return image_bytes_from_string(item)
    if ctype.startswith("image/") or ctype in ("application/pdf", "application/octet-stream"):
        data = await request.body()
        if not data:
            raise ApiError(415, "unsupported_media_type", "request body is empty")
        return data
    # application/json, or anything else (e.g. curl -d's default form type) parsed as JSON
    body = await read_json(request)
    try:
        req = EncodeRequest.model_validate(body)
    except ValidationError as e:
        raise ApiError(422, "invalid_request", validation_message(e)) from None
    return image_bytes_from_string(req.image)


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline on the request head: a connection that says nothing, or
    trickles its headers, is closed after `seconds` instead of holding an open file for ever (uvicorn
    only times out connections that are idle after a response)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole head arrived: the request's own deadline governs from here

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next head on this keep-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11


def raise_open_file_limit() -> None:
    """Soft limit up to the hard one: every client connection holds a file descriptor."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def main() -> int:
    """`python server.py`: uvicorn on HOST:PORT; exits non-zero when the model cannot be loaded. On
    SIGTERM/SIGINT the engine drains for SHUTDOWN_DRAIN_S, then answers what is left with a JSON 503,
    before uvicorn's own graceful timeout (2 s later) would cut those requests off."""
    import uvicorn
    global _fatal_hook
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if env_text("LOG_FORMAT", "text") == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=env_text("LOG_LEVEL", "info").upper(), handlers=[handler])
    host, port = env_text("HOST", "127.0.0.1"), env_number("PORT", 8000, int, 0)
    settings = Settings.from_env()
    app = create_app(settings)
    drain = settings.engine.shutdown_drain_s

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine = getattr(app.state, "engine", None)
            if engine is not None:
                engine.drain(drain)
            super().handle_exit(sig, frame)

    raise_open_file_limit()
    if not settings.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model "
                    "(set API_KEY or API_KEY_FILE)", host)
    # log_config=None: uvicorn's own lines go through the handler above (request ids, JSON)
    config = uvicorn.Config(app, host=host, port=port, log_level=env_text("LOG_LEVEL", "info").lower(), log_config=None,
                            timeout_graceful_shutdown=int(drain) + 2, access_log=env_text("ACCESS_LOG", "0") == "1",
                            http=header_timeout_protocol(settings.header_timeout_s),
                            limit_concurrency=settings.max_connections)
    server = Server(config)
    failure: list[str] = []

    def fatal(message: str) -> None:  # the engine has logged the message
        failure.append(message)
        server.should_exit = True

    _fatal_hook = fatal
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    if failure:  # repeated last, after uvicorn's shutdown lines, so it is what the user sees
        sys.stderr.write(f"ocr-latent: not serving: startup failed: {failure[0]}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
