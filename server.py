"""ocr-latent HTTP service: page image -> 4096 four-bit codes (/encode), codes -> page text (/decode).

One worker thread owns the model. The event loop only parses, validates and routes requests; every
model call (towers, prefill, decode steps, detokenisation) runs on the worker, which hands results
back through asyncio futures completed with `loop.call_soon_threadsafe`.

The worker is a dynamic micro-batcher:
  * /encode requests that arrive within ENCODE_BATCH_WINDOW_MS of each other (up to ENCODE_MAX_BATCH)
    go through the towers as one batch;
  * /decode requests join a running `decoder.Generator` (continuous batching, DECODE_SLOTS sequences
    in one batched KV cache) at the next step boundary and leave it as soon as they finish;
  * each turn of the loop runs at most one encode batch, admits waiting decodes into free slots
    (one batched prefill) and runs one decode step, so neither kind starves the other.
Requests waiting for the worker (not yet in a batch) form a bounded queue (MAX_QUEUE): a full queue
answers 503 with Retry-After. A request that is not done within REQUEST_TIMEOUT_S answers 504, and a
request whose client disconnects is dropped from the queue or the running batch.

Run with `./serve.sh` (or `python server.py`); configuration is by environment variable, see
`Settings` and the "Service" section of README.md.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from PIL import Image
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ocr_latent.server")

NUM_CODES, BITS_PER_CODE, PACKED_BYTES = 4096, 4, 2048
MAX_LEVEL = (1 << BITS_PER_CODE) - 1
# what /encode decodes (spec: PNG, JPEG, WebP, TIFF, BMP; MPO is how Pillow opens multi-picture camera
# JPEGs). Formats outside this list (EPS, which shells out to Ghostscript, PSD, ICO, ...) are a 415.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "TIFF", "BMP")
ENDPOINTS = ("/health", "/encode", "/decode", "/metrics")


# ----------------------------------------------------------------------------- configuration
def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value.strip() == "" else value.strip()


def _num(name: str, default, kind=int, minimum=None):
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if minimum is not None and value < minimum:
        raise SystemExit(f"{name}={raw!r} must be >= {minimum}")
    return value


@dataclass
class Settings:
    """Everything configurable, read from the environment (see README "Service")."""
    model_dir: str | None = None  # MODEL_DIR: original-layout DeepSeek-OCR dir; unset = embedded nano
    quantizer: str | None = None  # QUANTIZER: quantizer .safetensors; unset = the base's default
    device: str = "cpu"  # DEVICE
    dtype: str = "float32"  # DTYPE: float32 | bf16 | fp16 (default bf16 when DEVICE is not cpu)
    prefill_dtype: str | None = None  # PREFILL_DTYPE: the prompts' precision (default: pipeline.default_prefill_dtype)
    torch_threads: int | None = None  # TORCH_THREADS
    encode_batch_window_ms: float = 5.0  # ENCODE_BATCH_WINDOW_MS
    encode_max_batch: int = 8  # ENCODE_MAX_BATCH
    decode_slots: int = 16  # DECODE_SLOTS
    max_queue: int = 64  # MAX_QUEUE: requests waiting for the worker (not yet batched)
    request_timeout_s: float = 120.0  # REQUEST_TIMEOUT_S: per-request deadline -> 504
    max_body_bytes: int = 20_000_000  # MAX_BODY_BYTES -> 413
    max_image_pixels: int = 40_000_000  # MAX_IMAGE_PIXELS -> 413
    retry_after_s: int = 1  # RETRY_AFTER_S: Retry-After on a full queue
    loading_retry_after_s: int = 5  # Retry-After while loading
    load_delay_s: float = 0.0  # OCR_LATENT_TEST_LOAD_DELAY_S: tests only, widens the loading window
    step_delay_s: float = 0.0  # OCR_LATENT_TEST_STEP_DELAY_S: tests only, a slow model (sleep per decode step)
    warmup_tokens: int = 4

    @classmethod
    def from_env(cls) -> "Settings":
        # bf16 on accelerators: DeepSeek-OCR's own serving dtype, and the MoE's grouped-GEMM path
        dtype = _env("DTYPE", "float32" if _env("DEVICE", "cpu") == "cpu" else "bf16").lower()
        prefill_dtype = _env("PREFILL_DTYPE", "").lower() or None
        for name, value in (("DTYPE", dtype), ("PREFILL_DTYPE", prefill_dtype or "float32")):
            if value not in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"):
                raise SystemExit(f"{name}={value!r}: use float32, bf16 or fp16")
        return cls(
            model_dir=_env("MODEL_DIR"), quantizer=_env("QUANTIZER"), device=_env("DEVICE", "cpu"), dtype=dtype,
            prefill_dtype=prefill_dtype,
            torch_threads=_num("TORCH_THREADS", None, int, 1),
            encode_batch_window_ms=_num("ENCODE_BATCH_WINDOW_MS", 5.0, float, 0),
            encode_max_batch=_num("ENCODE_MAX_BATCH", 8, int, 1),
            decode_slots=_num("DECODE_SLOTS", 16, int, 1),
            max_queue=_num("MAX_QUEUE", 64, int, 1),
            request_timeout_s=_num("REQUEST_TIMEOUT_S", 120.0, float, 0.001),
            max_body_bytes=_num("MAX_BODY_BYTES", 20_000_000, int, 1),
            max_image_pixels=_num("MAX_IMAGE_PIXELS", 40_000_000, int, 1),
            retry_after_s=_num("RETRY_AFTER_S", 1, int, 0),
            load_delay_s=_num("OCR_LATENT_TEST_LOAD_DELAY_S", 0.0, float, 0),
            step_delay_s=_num("OCR_LATENT_TEST_STEP_DELAY_S", 0.0, float, 0),
        )


# ----------------------------------------------------------------------------- API models
class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: StrictStr = Field(description="the image file's bytes as base64, or a data URL "
                                         "(data:image/png;base64,...)")


class EncodeResponse(BaseModel):
    codes: list[int] = Field(description="4096 codes, each 0..15")
    codes_b64: str = Field(description="the codes packed two per byte (first code in the high nibble), "
                                       "2048 bytes, base64")
    num_codes: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    codes: list[StrictInt] | None = Field(None, description="4096 ints in 0..15 (exactly one of codes, codes_b64)")
    codes_b64: StrictStr | None = Field(None, description="2048 packed bytes as base64, as /encode returns them")
    prompt: Literal["free", "markdown"] = Field("free", description='"free": <image>\\nFree OCR.; "markdown": '
                                                "<image>\\n<|grounding|>Convert the document to markdown.")
    max_tokens: StrictInt = Field(4096, ge=1, le=8192, description="most tokens to generate (EOS included)")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.codes is None) == (self.codes_b64 is None):
            raise ValueError("give exactly one of codes and codes_b64")
        if self.codes is not None:
            if len(self.codes) != NUM_CODES:
                raise ValueError(f"codes has {len(self.codes)} entries; need exactly {NUM_CODES}")
            bad = next((i for i, c in enumerate(self.codes) if not 0 <= c <= MAX_LEVEL), None)
            if bad is not None:
                raise ValueError(f"codes[{bad}] = {self.codes[bad]} is out of range 0..{MAX_LEVEL}")
        return self


class DecodeResponse(BaseModel):
    text: str
    num_tokens: int = Field(description="tokens of the text, the end-of-sequence token not counted; "
                                        "== max_tokens when finish_reason is length")
    finish_reason: Literal["stop", "length", "repetition"]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    revision: str
    codes_per_image: int = NUM_CODES
    bits_per_code: int = BITS_PER_CODE
    device: str


class LoadingResponse(BaseModel):
    status: Literal["loading", "failed"]
    error: dict | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ----------------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers or {}


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class StartupError(RuntimeError):
    """A configuration problem found while loading: reported as its message alone."""


def error_response(status: int, type: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=headers)


HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
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
    from encoder import load_image
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


# ----------------------------------------------------------------------------- metrics
class Metrics:
    def __init__(self):
        disable_created_metrics()  # no *_created series: they only add noise to scrapes
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ocr_latent_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("ocr_latent_request_seconds", "HTTP request latency by endpoint", ["endpoint"],
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 25, 60, 120, 300),
                                 registry=r)
        self.queue_depth = Gauge("ocr_latent_queue_depth", "requests waiting for the worker", ["kind"], registry=r)
        self.queue_wait = Histogram("ocr_latent_queue_wait_seconds", "time from arrival to entering a batch",
                                    ["kind"], buckets=(.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 120), registry=r)
        self.encode_batch = Histogram("ocr_latent_encode_batch_size", "images per encode batch",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.encode_seconds = Histogram("ocr_latent_encode_batch_seconds", "seconds per encode batch",
                                        buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.decode_batch = Histogram("ocr_latent_decode_batch_size", "running sequences per decode step",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128), registry=r)
        self.prefill_batch = Histogram("ocr_latent_prefill_batch_size", "sequences per prefill",
                                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("ocr_latent_decode_step_seconds", "seconds per decode step",
                                      buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.prefill_seconds = Histogram("ocr_latent_prefill_seconds", "seconds per prefill (prompts into the cache)",
                                         buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10), registry=r)
        self.active = Gauge("ocr_latent_active_sequences", "sequences in the running decode batch", registry=r)
        self.images = Counter("ocr_latent_encoded_images_total", "images encoded", registry=r)
        self.tokens = Counter("ocr_latent_decode_tokens_total", "tokens generated (EOS included)", registry=r)
        self.tokens_per_s = Gauge("ocr_latent_decode_tokens_per_second",
                                  "decode throughput over the last few seconds", registry=r)
        self.finish = Counter("ocr_latent_decode_finished_total", "finished decodes by reason", ["reason"],
                              registry=r)
        self.dropped = Counter("ocr_latent_dropped_total", "requests dropped by the worker", ["reason"], registry=r)
        self.ready = Gauge("ocr_latent_ready", "1 once the model is loaded and warmed up", registry=r)
        self._window: deque[tuple[float, int]] = deque()

    def count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.tokens.inc(n)
        self._window.append((now, n))
        self._update_rate(now)

    def _update_rate(self, now: float, horizon: float = 5.0) -> None:
        while self._window and self._window[0][0] < now - horizon:
            self._window.popleft()
        if not self._window:
            self.tokens_per_s.set(0)
            return
        span = max(now - self._window[0][0], 1.0)
        self.tokens_per_s.set(sum(n for _, n in self._window) / span)

    def render(self) -> bytes:
        self._update_rate(time.monotonic())
        return generate_latest(self.registry)


# ----------------------------------------------------------------------------- the worker
@dataclass(eq=False)
class Job:
    kind: str  # "encode" | "decode"
    payload: Any  # encode: PIL image; decode: (codes uint8 [4096], prompt, max_tokens)
    future: asyncio.Future
    deadline: float  # time.monotonic()
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    seq: Any = None  # decoder.Sequence while decoding


class Worker:
    """The one thread that owns the model (see the module docstring)."""

    def __init__(self, settings: Settings, metrics: Metrics, loop: asyncio.AbstractEventLoop, on_fatal):
        self.s, self.m, self.loop, self.on_fatal = settings, metrics, loop, on_fatal
        self.cv = threading.Condition()
        self.encodes: deque[Job] = deque()
        self.decodes: deque[Job] = deque()
        self.running: list[Job] = []  # decode jobs whose sequences are in the generator
        self.pipeline = None
        self.gen = None
        self.ready = False
        self.failed: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._main, name="ocr-latent-worker", daemon=True)

    # -- called from the event loop
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cv:
            if self.stopping:
                raise ApiError(503, "unavailable", "the server is shutting down",
                               {"Retry-After": str(self.s.loading_retry_after_s)})
            # requests that the next turn of the worker takes (into free decode slots, into the next
            # encode batch) are not waiting; MAX_QUEUE bounds the ones behind those
            decodes = sum(not j.cancelled for j in self.decodes) + (job.kind == "decode")
            encodes = len(self.encodes) + (job.kind == "encode")
            slots = self.gen.capacity if self.gen is not None else 0
            waiting = max(0, decodes - slots) + max(0, encodes - self.s.encode_max_batch)
            if waiting > self.s.max_queue:
                raise ApiError(503, "overloaded", f"the queue is full ({self.s.max_queue} requests waiting, "
                                                  "MAX_QUEUE); retry later", {"Retry-After": str(self.s.retry_after_s)})
            (self.encodes if job.kind == "encode" else self.decodes).append(job)
            self._gauge_queue()
            self.cv.notify()

    def poke(self) -> None:
        with self.cv:
            self.cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- worker thread
    def _resolve(self, job: Job, result=None, error: BaseException | None = None) -> None:
        def done(fut=job.future):
            if job.cancelled or fut.done():  # its handler has given up (timeout, hang-up): nobody awaits it
                return
            fut.set_exception(error) if error is not None else fut.set_result(result)
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(done)

    def _gauge_queue(self) -> None:
        self.m.queue_depth.labels("encode").set(len(self.encodes))
        self.m.queue_depth.labels("decode").set(len(self.decodes))

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as e:  # noqa: BLE001 - any load failure is fatal and must be reported
            from checkpoint import CheckpointError
            message = str(e) if isinstance(e, (CheckpointError, FileNotFoundError, StartupError)) else \
                f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            self.failed = message
            log.error("startup failed: %s", message)
            self.on_fatal(message)
            return
        try:
            self._serve()
        except BaseException:  # should be unreachable: _serve catches per batch
            log.critical("worker crashed:\n%s", traceback.format_exc())
            self.failed = "worker crashed"
            self.ready = False
            self.m.ready.set(0)
            self.on_fatal("worker crashed")
        finally:
            self._fail_everything(ApiError(503, "unavailable", "the server is shutting down",
                                           {"Retry-After": str(self.s.loading_retry_after_s)}))

    def _load(self) -> None:
        import torch
        if self.s.torch_threads:
            torch.set_num_threads(self.s.torch_threads)
        if self.s.load_delay_s:
            time.sleep(self.s.load_delay_s)
        t0 = time.monotonic()
        from pipeline import NUM_CODES as pipeline_codes, load_pipeline
        if self.s.device.startswith("cuda") and not torch.cuda.is_available():
            raise StartupError(f"DEVICE={self.s.device} but torch {torch.__version__} sees no CUDA device: install "
                               "a CUDA build of torch==2.13.0 in .venv or use DEVICE=cpu")
        if pipeline_codes != NUM_CODES:
            raise StartupError(f"architecture.json has {pipeline_codes} codes; this server speaks {NUM_CODES}")
        self.pipeline = load_pipeline(self.s.model_dir, self.s.quantizer, self.s.device, self.s.dtype, self.s.prefill_dtype)
        if "free" not in self.pipeline.prompts:
            raise StartupError("the model's tokenizer cannot spell the 'free' prompt")
        self.gen = self.pipeline.new_generator(self.s.decode_slots)
        t1 = time.monotonic()
        # warm-up: one encode and one short decode through the same code path as requests
        codes = self.pipeline.encode([Image.new("RGB", (64, 64), (255, 255, 255))])
        if codes.shape != (1, NUM_CODES) or int(codes.max()) > MAX_LEVEL:
            raise StartupError(f"warm-up encode gave codes of shape {codes.shape} (max {int(codes.max())}); this "
                               f"service needs {NUM_CODES} codes in 0..{MAX_LEVEL}: check the model's view mode "
                               "and QUANTIZER")
        seq = self.gen.add([self.pipeline.decode_inputs(codes[0], "free")], [self.s.warmup_tokens])[0]
        while seq.finish_reason is None:
            self.gen.step()
        self.gen.drop(seq)
        self.pipeline.text(seq.tokens)
        log.info("model %s (%s) loaded in %.1fs, warmed up in %.1fs on %s (%s, prefill %s); prompts: %s",
                 self.pipeline.label, self.pipeline.revision, t1 - t0, time.monotonic() - t1, self.pipeline.device,
                 self.pipeline.model.decoder.lm_head.weight.dtype, self.pipeline.prefill_dtype,
                 ", ".join(self.pipeline.prompts))
        self.ready = True
        self.m.ready.set(1)

    def _take(self, queue: deque, limit: int) -> list[Job]:
        out = []
        while queue and len(out) < limit:
            job = queue.popleft()
            if job.cancelled:
                self.m.dropped.labels("cancelled").inc()
                continue
            if time.monotonic() > job.deadline:
                self.m.dropped.labels("timeout").inc()
                self._resolve(job, error=timeout_error(self.s))
                continue
            out.append(job)
        return out

    def _serve(self) -> None:
        window = self.s.encode_batch_window_ms / 1000
        while True:
            with self.cv:
                while not (self.stopping or self.encodes or self.decodes or self.running):
                    self.m.tokens_per_s.set(0)
                    self.cv.wait()
                if self.stopping:
                    return
                # an idle worker holds a lone encode for the batching window so that concurrent
                # requests share one forward; with decodes running, a decode step is the window
                if self.encodes and not self.running and not self.decodes:
                    until = self.encodes[0].arrived + window
                    while (not self.stopping and len(self.encodes) < self.s.encode_max_batch
                           and (left := until - time.monotonic()) > 0):
                        self.cv.wait(left)
                encode_batch = self._take(self.encodes, self.s.encode_max_batch)
                admit = self._take(self.decodes, self.gen.capacity)
                self._gauge_queue()
            if encode_batch:
                self._encode(encode_batch)
            self._reap()
            if admit:
                self._admit(admit)
            if any(j.seq.finish_reason is None for j in self.running):
                self._step()

    def _encode(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        for j in jobs:
            self.m.queue_wait.labels("encode").observe(now - j.arrived)
        t0 = time.perf_counter()
        try:
            codes = self.pipeline.encode([j.payload for j in jobs])
        except Exception:  # noqa: BLE001
            log.error("encode batch of %d failed; retrying one by one:\n%s", len(jobs), traceback.format_exc())
            for j in jobs:
                try:
                    self._resolve(j, self.pipeline.encode([j.payload])[0].copy())
                except Exception as e:  # noqa: BLE001
                    log.error("encode failed:\n%s", traceback.format_exc())
                    self._resolve(j, error=ApiError(500, "internal", f"encoding failed: {type(e).__name__}: {e}"))
            return
        self.m.encode_seconds.observe(time.perf_counter() - t0)
        self.m.encode_batch.observe(len(jobs))
        self.m.images.inc(len(jobs))
        for j, c in zip(jobs, codes):
            self._resolve(j, c.copy())

    def _admit(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        inputs, ok = [], []
        for j in jobs:
            self.m.queue_wait.labels("decode").observe(now - j.arrived)
            codes, prompt, _ = j.payload
            try:
                inputs.append(self.pipeline.decode_inputs(codes, prompt))
                ok.append(j)
            except Exception as e:  # noqa: BLE001
                log.error("decode_inputs failed:\n%s", traceback.format_exc())
                self._resolve(j, error=ApiError(500, "internal", f"decoding failed: {type(e).__name__}: {e}"))
        if not ok:
            return
        t0 = time.perf_counter()
        try:
            seqs = self.gen.add(inputs, [j.payload[2] for j in ok])
        except Exception as e:  # noqa: BLE001
            self._generator_failed(e, ok)
            return
        self.m.prefill_seconds.observe(time.perf_counter() - t0)
        self.m.prefill_batch.observe(len(ok))
        self.m.count_tokens(len(ok))
        for j, seq in zip(ok, seqs):
            j.seq = seq
            self.running.append(j)
        self._finish_done()

    def _step(self) -> None:
        n = sum(j.seq.finish_reason is None for j in self.running)
        t0 = time.perf_counter()
        try:
            self.gen.step()
        except Exception as e:  # noqa: BLE001
            self._generator_failed(e, [])
            return
        if self.s.step_delay_s:
            time.sleep(self.s.step_delay_s)
        self.m.step_seconds.observe(time.perf_counter() - t0)
        self.m.decode_batch.observe(n)
        self.m.count_tokens(n)
        self._finish_done()

    def _finish_done(self) -> None:
        still = []
        for j in self.running:
            seq = j.seq
            if seq.finish_reason is None:
                still.append(j)
                continue
            self.gen.drop(seq)
            try:
                text = self.pipeline.text(seq.tokens)
            except Exception as e:  # noqa: BLE001
                self._resolve(j, error=ApiError(500, "internal", f"detokenising failed: {type(e).__name__}: {e}"))
                continue
            n = len(seq.tokens) - (1 if seq.finish_reason == "stop" else 0)
            self.m.finish.labels(seq.finish_reason).inc()
            self._resolve(j, {"text": text, "num_tokens": n, "finish_reason": seq.finish_reason})
        self.running = still
        self.m.active.set(len(self.running))

    def _reap(self) -> None:
        """Drop sequences whose client went away or whose deadline passed."""
        if not self.running:
            return
        now, still = time.monotonic(), []
        for j in self.running:
            if j.cancelled or now > j.deadline:
                self.gen.drop(j.seq)
                self.m.dropped.labels("cancelled" if j.cancelled else "timeout").inc()
                if not j.cancelled:
                    self._resolve(j, error=timeout_error(self.s))
            else:
                still.append(j)
        self.running = still
        self.m.active.set(len(self.running))

    def _generator_failed(self, e: Exception, extra: list[Job]) -> None:
        """The generator's state is unknown after an exception: fail its sequences, start a fresh one."""
        log.error("decode batch failed; restarting the generator:\n%s", traceback.format_exc())
        err = ApiError(500, "internal", f"decoding failed: {type(e).__name__}: {e}")
        for j in self.running + extra:
            self._resolve(j, error=err)
        self.running = []
        self.m.active.set(0)
        self.gen = self.pipeline.new_generator(self.s.decode_slots)

    def _fail_everything(self, err: ApiError) -> None:
        with self.cv:
            pending = list(self.encodes) + list(self.decodes) + self.running
            self.encodes.clear(), self.decodes.clear()
            self.running = []
        for j in pending:
            self._resolve(j, error=err)


def timeout_error(s: Settings) -> ApiError:
    return ApiError(504, "timeout", f"the request did not finish within {s.request_timeout_s:g}s (REQUEST_TIMEOUT_S)")


# ----------------------------------------------------------------------------- ASGI guard
class Guard:
    """Outermost middleware: the body-size limit (413 from Content-Length before reading, or as soon as
    a streamed body passes it) and per-request metrics."""

    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app, self.s, self.m = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        t0, state = time.perf_counter(), {"status": 500, "started": False}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
            await send(message)

        limit = self.s.max_body_bytes
        too_large = error_response(413, "payload_too_large",
                                   f"request body is larger than {limit} bytes (MAX_BODY_BYTES)")
        try:
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


# ----------------------------------------------------------------------------- the app
_fatal_hook = None  # set by main(): ends uvicorn with a non-zero exit status


def _default_fatal(message: str) -> None:
    """Outside main() (e.g. `uvicorn server:app`): a server without a model must not linger."""
    if _fatal_hook is not None:
        _fatal_hook(message)
        return
    sys.stderr.flush()
    os._exit(1)


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or Settings.from_env()
    metrics = Metrics()
    Image.MAX_IMAGE_PIXELS = s.max_image_pixels  # Pillow's own bomb check; above 2x it raises at open
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we reject those sizes ourselves

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = Worker(s, metrics, asyncio.get_running_loop(), _default_fatal)
        app.state.worker = worker
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    errors = {code: {"model": ErrorResponse} for code in (400, 413, 415, 422, 503, 504)}
    app = FastAPI(title="ocr-latent", version="0.1.0", lifespan=lifespan,
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, HTTP_ERROR_TYPES.get(exc.status_code, "error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unhandled error:\n%s", "".join(traceback.format_exception(exc)))
        return error_response(500, "internal", f"internal error: {type(exc).__name__}")

    def worker_of(request: Request) -> Worker:
        worker: Worker = request.app.state.worker
        if not worker.ready:
            if worker.failed:
                raise ApiError(503, "unavailable", f"the model failed to load: {worker.failed.splitlines()[0]}")
            raise ApiError(503, "loading", "the model is still loading",
                           {"Retry-After": str(s.loading_retry_after_s)})
        return worker

    async def run_job(request: Request, worker: Worker, kind: str, payload) -> Any:
        loop = asyncio.get_running_loop()
        job = Job(kind, payload, loop.create_future(), time.monotonic() + s.request_timeout_s)
        worker.submit(job)
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=s.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not job.future.done():  # timed out, client gone, or this task cancelled
                job.cancelled = True
                worker.poke()
        if job.future.done():
            return job.future.result()
        if gone in done:
            raise ClientGone()
        raise timeout_error(s)

    # ------------------------------------------------------------------ endpoints
    @app.get("/health", response_model=HealthResponse,
             responses={503: {"model": LoadingResponse, "description": "loading (or failed to load)"}})
    async def health(request: Request):
        worker: Worker = request.app.state.worker
        if worker.ready:
            p = worker.pipeline
            return HealthResponse(status="ok", model=p.label, revision=p.revision, device=p.device)
        if worker.failed:
            return JSONResponse({"status": "failed", "error": {"type": "startup_failed",
                                                               "message": worker.failed.splitlines()[0]}},
                                status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503,
                            headers={"Retry-After": str(s.loading_retry_after_s)})

    encode_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": EncodeRequest.model_json_schema()},
        "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "binary", "description": "the image file"}}}},
        "image/*": {"schema": {"type": "string", "format": "binary"}}}}}

    @app.post("/encode", response_model=EncodeResponse, responses=errors, openapi_extra=encode_body)
    async def encode(request: Request):
        """A page image -> 4096 codes. JSON {"image": base64 or data URL}, multipart field `image`, or
        the raw image bytes with an image/* Content-Type."""
        worker = worker_of(request)
        data = await read_image_bytes(request, s)
        image = await asyncio.to_thread(open_image, data, s.max_image_pixels)
        try:
            codes = await run_job(request, worker, "encode", image)
        except ClientGone:
            return error_response(499, "client_closed_request", "the client disconnected")
        from quantizer import pack
        return EncodeResponse(codes=codes.tolist(), codes_b64=base64.b64encode(pack(codes)).decode())

    decode_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": DecodeRequest.model_json_schema()}}}}

    @app.post("/decode", response_model=DecodeResponse, responses=errors, openapi_extra=decode_body)
    async def decode(request: Request):
        """4096 codes (`codes` or `codes_b64`) -> the page's text, greedy."""
        worker = worker_of(request)
        body = parse_json(await request.body())
        try:
            req = DecodeRequest.model_validate(body)
        except ValidationError as e:
            raise ApiError(422, "invalid_request", validation_message(e)) from None
        if req.codes is not None:
            codes = np.asarray(req.codes, dtype=np.uint8)
        else:
            raw = b64decode(req.codes_b64, "codes_b64")
            if len(raw) != PACKED_BYTES:
                raise ApiError(422, "invalid_request", f"codes_b64 holds {len(raw)} bytes = {2 * len(raw)} codes; "
                                                       f"need exactly {PACKED_BYTES} bytes ({NUM_CODES} codes)")
            from quantizer import unpack
            codes = unpack(raw).astype(np.uint8)
        if req.prompt not in worker.pipeline.prompts:
            raise ApiError(422, "invalid_request", f"prompt {req.prompt!r} is not available for model "
                                                   f"{worker.pipeline.label!r} (available: "
                                                   f"{', '.join(worker.pipeline.prompts)})")
        try:
            result = await run_job(request, worker, "decode", (codes, req.prompt, req.max_tokens))
        except ClientGone:
            return error_response(499, "client_closed_request", "the client disconnected")
        return DecodeResponse(**result)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guard, settings=s, metrics=metrics)
    return app


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def parse_json(body: bytes) -> Any:
    if not body.strip():
        raise ApiError(400, "invalid_json", "request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {e}") from None


async def read_image_bytes(request: Request, s: Settings) -> bytes:
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
    if ctype.startswith("image/") or ctype == "application/octet-stream":
        data = await request.body()
        if not data:
            raise ApiError(415, "unsupported_media_type", "request body is empty")
        return data
    # application/json, or anything else (e.g. curl -d's default form type) parsed as JSON
    body = parse_json(await request.body())
    try:
        req = EncodeRequest.model_validate(body)
    except ValidationError as e:
        raise ApiError(422, "invalid_request", validation_message(e)) from None
    return image_bytes_from_string(req.image)


app = create_app()


def main() -> int:
    """`python server.py`: uvicorn on HOST:PORT; exits non-zero when the model cannot be loaded."""
    import uvicorn
    global _fatal_hook
    logging.basicConfig(level=_env("LOG_LEVEL", "info").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = _env("HOST", "0.0.0.0"), _num("PORT", 8000, int, 0)
    config = uvicorn.Config(app, host=host, port=port, log_level=_env("LOG_LEVEL", "info").lower(),
                            timeout_graceful_shutdown=10, access_log=_env("ACCESS_LOG", "0") == "1")
    server = uvicorn.Server(config)
    failure: list[str] = []

    def fatal(message: str) -> None:  # the worker has logged the message
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
