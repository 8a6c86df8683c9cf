"""Admission: the outermost ASGI middleware (`Guard`: request ids, the API key, the body-size limit, request
metrics), the budget of memory that images being decoded may hold (`DecodeBudget`), and the log formats
that name the request each line was written for; `trim_memory`, which gives what a large image freed
back to the system."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import ctypes
import functools
import hmac
import json
import logging
import re
import time
import uuid

from ocr_latent.serving.http_errors import ApiError, BodyTooLarge, error_response
from ocr_latent.serving.settings import Settings
from ocr_latent.serving.telemetry import Metrics

ENDPOINTS = ("/health", "/encode", "/decode", "/metrics")
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
    """Exactly one `Authorization: Bearer <API_KEY>`, compared in constant time (with two, proxies and
    this server could each believe another one)."""
    given = [value for name, value in scope["headers"] if name == b"authorization"]
    if len(given) != 1:
        return False
    scheme, _, token = given[0].decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class Guard:
    """Outermost middleware: the request id (the client's X-Request-ID when well-formed, else a new one;
    returned on the response, in every log line), the API key (401 before anything is read), the body-size
    limit (413 from Content-Length before reading, or as soon as a streamed body passes it) and metrics."""

    def __init__(self, app, settings: Settings, api_key: str | None, metrics: Metrics):
        self.app, self.s, self.api_key, self.m = app, settings, api_key, metrics

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
            if self.api_key and scope["path"].rstrip("/") in PROTECTED and not authorized(scope, self.api_key):
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
        except asyncio.CancelledError:
            # Ray Serve's proxy cancels a request whose client hung up: a 499 like the plain server's, not a 500
            if not state["started"]:
                state["status"] = 499
            raise
        finally:
            self.m.requests.labels(endpoint, str(state["status"])).inc()
            self.m.latency.labels(endpoint).observe(time.perf_counter() - t0)
            request_id.reset(token)


class DecodeBudget:
    """Bytes that images being decoded may hold at once (IMAGE_MEMORY_BYTES), judged from their headers
    before decoding (documents.decoded_bytes). A request whose image does not fit waits its turn, first come
    first served; with `max_waiting` already waiting, or after `wait_s`, it gets a 503 with Retry-After. An
    image larger than the whole budget is decoded alone. Used from the event loop only (no locks)."""

    def __init__(self, total: int, max_waiting: int, wait_s: float, retry_after_s: int):
        self.total, self.max_waiting, self.wait_s, self.retry_after_s = total, max_waiting, wait_s, retry_after_s
        self.used = 0
        self.waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def overloaded(self, why: str) -> ApiError:
        return ApiError(503, "overloaded", f"{why} (IMAGE_MEMORY_BYTES={self.total}); retry later, or send "
                                           f"smaller images", {"Retry-After": str(self.retry_after_s)})

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int):
        nbytes = min(nbytes, self.total)
        if self.waiting or self.used + nbytes > self.total:
            if len(self.waiting) >= self.max_waiting:
                raise self.overloaded(f"{len(self.waiting)} images wait for memory to be decoded in")
            turn = asyncio.get_running_loop().create_future()
            self.waiting.append((nbytes, turn))
            try:
                await asyncio.wait_for(turn, self.wait_s)
            except (asyncio.CancelledError, TimeoutError) as e:
                if turn.done() and not turn.cancelled():
                    self._release(nbytes)  # its turn came as it gave up
                with contextlib.suppress(ValueError):
                    self.waiting.remove((nbytes, turn))
                if isinstance(e, TimeoutError):
                    raise self.overloaded(f"no memory to decode the image in came free within {self.wait_s:g} s "
                                          f"(REQUEST_TIMEOUT_S)") from None
                raise
        else:
            self.used += nbytes
        try:
            yield
        finally:
            self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        while self.waiting and self.used + self.waiting[0][0] <= self.total:
            n, turn = self.waiting.popleft()
            if not turn.done():
                self.used += n
                turn.set_result(None)


TRIM_FROM_BYTES = 32 << 20  # an image whose decoding held this much has its freed memory given back at once


@functools.cache
def _libc():
    return ctypes.CDLL(None)


def trim_memory() -> bool:
    """Give the free pages of every malloc arena back to the system (glibc's malloc_trim). glibc keeps what
    a thread freed in that thread's arena, for that thread: after 8 concurrent 6000x6600 PNGs, each decoded
    on a thread of its own, the server stayed 1 GB larger for good; a trim gave it back (to 70 MB above
    idle; docs/performance.md). Called after large decodes only: it walks every arena. False where the C
    library has no malloc_trim (not glibc)."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
