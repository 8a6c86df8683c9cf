"""Admission: the outermost ASGI middleware (`Guard`: request ids, the API key, the request's framing, the
body-size limit, the bodies held at once, request metrics), the budget of memory that pages may hold from
their decoding until the engine is done with them (`DecodeBudget`), and the log formats that name the
request each line was written for."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
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


# what the connection's protocol (serving/runner.py) and the endpoints tell the Guard through the request's scope
STARTED = "ocr_latent.started"  # time.monotonic() when the request's head had arrived: its deadline counts from it
STATUS = "ocr_latent.status"  # the status to count when the response could not say it: 408 (body too slow), 499


class Guard:
    """Outermost middleware: the request id (the client's X-Request-ID when well-formed, else a new one;
    returned on the response, in every log line), the API key (401 before anything is read), the request's
    framing (Content-Length with Transfer-Encoding: a 400, and the connection closed), the body-size limit
    (413 from Content-Length before reading, or as soon as a streamed body passes it), the bodies held at
    once (BODY_MEMORY_BYTES: a 503 before reading what does not fit) and metrics."""

    def __init__(self, app, settings: Settings, api_key: str | None, metrics: Metrics):
        self.app, self.s, self.api_key, self.m = app, settings, api_key, metrics
        self.bodies = BodyBudget(settings.body_memory_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault(STARTED, time.monotonic())
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        t0, state = time.perf_counter(), {"status": 500, "started": False}

        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id.set(rid)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        limit = self.s.max_body_bytes
        held = 0
        try:
            if self.api_key and scope["path"].rstrip("/") in PROTECTED and not authorized(scope, self.api_key):
                await error_response(401, "unauthorized", "send the API key as 'Authorization: Bearer <key>' (API_KEY)",
                                     {"WWW-Authenticate": "Bearer"})(scope, receive, send_wrapper)
                return
            if b"content-length" in headers and b"transfer-encoding" in headers:
                # RFC 9112 6.1: a proxy that reads the length and this server that reads the chunks would see two
                # different requests on one connection; it is refused and the connection closed
                await error_response(400, "bad_request", "the request has both Content-Length and Transfer-Encoding; "
                                     "send one of them", {"Connection": "close"})(scope, receive, send_wrapper)
                return
            try:
                declared = int(headers[b"content-length"]) if b"content-length" in headers else None
            except ValueError:
                declared = None
            if declared is not None and declared > limit:
                await self.too_large(scope, receive, send_wrapper)
                return
            if declared and not self.bodies.take(declared):
                await self.no_room(scope, receive, send_wrapper)
                return
            held = declared or 0
            received = 0

            async def receive_wrapper():
                nonlocal received, held
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge()
                    if received > held:  # chunked, or more than it declared (the server refuses that itself)
                        if not self.bodies.take(received - held):
                            raise BodyOverBudget()
                        held = received
                return message

            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except BodyTooLarge:
                if not state["started"]:
                    await self.too_large(scope, receive, send_wrapper)
            except BodyOverBudget:
                if not state["started"]:
                    await self.no_room(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            # Ray Serve's proxy cancels a request whose client hung up: a 499 like the plain server's, not a 500
            if not state["started"]:
                state["status"] = 499
            raise
        finally:
            self.bodies.give(held)
            status = scope.get(STATUS, state["status"])
            self.m.requests.labels(endpoint, str(status)).inc()
            self.m.latency.labels(endpoint).observe(time.perf_counter() - t0)
            request_id.reset(token)

    def too_large(self, scope, receive, send):
        return error_response(413, "payload_too_large", f"request body is larger than {self.s.max_body_bytes} bytes "
                                                        f"(MAX_BODY_BYTES)")(scope, receive, send)

    def no_room(self, scope, receive, send):
        return error_response(503, "overloaded", f"the request bodies being received already hold the memory they may "
                                                 f"(BODY_MEMORY_BYTES={self.s.body_memory_bytes}); retry shortly",
                              {"Retry-After": str(self.s.retry_after_s), "Connection": "close"})(scope, receive, send)


class BodyOverBudget(Exception):
    pass


class Hold:
    """Bytes held in a DecodeBudget; `shrink` gives back what a page no longer needs (its decoded pixels once
    only its view is left)."""

    def __init__(self, budget: "DecodeBudget", nbytes: int):
        self.budget, self.nbytes = budget, nbytes

    def shrink(self, nbytes: int) -> None:
        if nbytes < self.nbytes:
            self.budget._release(self.nbytes - nbytes)
            self.nbytes = nbytes


class DecodeBudget:
    """Bytes that pages may hold at once (IMAGE_MEMORY_BYTES), from the moment their decoding starts until the
    engine is done with them: judged from an image's header before decoding (documents.decoded_bytes), then
    its view's bytes once decoded (`Hold.shrink`). A request whose bytes fit goes ahead even while others wait
    for more room than is free, until the first of those has waited `PATIENCE_S`: from then on turns go in
    order, so a stream of small images cannot starve a large one. With `max_waiting` already waiting, or after
    `wait_s`, a 503 with Retry-After. An image larger than the whole budget is decoded alone. Used from the
    event loop only (no locks)."""
    PATIENCE_S = 2.0

    def __init__(self, total: int, max_waiting: int, wait_s: float, retry_after_s: int):
        self.total, self.max_waiting, self.wait_s, self.retry_after_s = total, max_waiting, wait_s, retry_after_s
        self.used = 0
        self.waiting: collections.deque[tuple[int, asyncio.Future, float]] = collections.deque()

    def overloaded(self, why: str) -> ApiError:
        return ApiError(503, "overloaded", f"{why} (IMAGE_MEMORY_BYTES={self.total}); retry later, or send "
                                           f"smaller images", {"Retry-After": str(self.retry_after_s)})

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int):
        nbytes = min(nbytes, self.total)
        if self.used + nbytes <= self.total and self._may_pass():
            self.used += nbytes
        else:
            if len(self.waiting) >= self.max_waiting:
                raise self.overloaded(f"{len(self.waiting)} images wait for memory to be decoded in")
            turn = asyncio.get_running_loop().create_future()
            entry = (nbytes, turn, time.monotonic())
            self.waiting.append(entry)
            try:
                await asyncio.wait_for(turn, self.wait_s)
            except (asyncio.CancelledError, TimeoutError) as e:
                if turn.done() and not turn.cancelled():
                    self._release(nbytes)  # its turn came as it gave up
                with contextlib.suppress(ValueError):
                    self.waiting.remove(entry)
                self._wake()  # the first in line may have gone: those behind it may pass now
                if isinstance(e, TimeoutError):
                    raise self.overloaded(f"no memory to decode the image in came free within {self.wait_s:g} s "
                                          f"(REQUEST_TIMEOUT_S)") from None
                raise
        hold = Hold(self, nbytes)
        try:
            yield hold
        finally:
            self._release(hold.nbytes)

    def _may_pass(self) -> bool:
        """Whether one that fits may go ahead of those waiting: until the first has waited PATIENCE_S."""
        return not self.waiting or time.monotonic() - self.waiting[0][2] < self.PATIENCE_S

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self.waiting and self.used + self.waiting[0][0] <= self.total:  # in order, while they fit
            n, turn, _ = self.waiting.popleft()
            if not turn.done():
                self.used += n
                turn.set_result(None)
        if self.waiting and self._may_pass():  # then those behind that fit in what is left
            for entry in list(self.waiting)[1:]:
                n, turn, _ = entry
                if self.used + n <= self.total:
                    self.waiting.remove(entry)
                    if not turn.done():
                        self.used += n
                        turn.set_result(None)


class BodyBudget:
    """Bytes of request bodies held at once across requests (BODY_MEMORY_BYTES): a body's declared length is
    reserved before any of it is read, a chunked body's as it arrives, and given back when its request ends.
    What does not fit is a 503 with Retry-After: slow or large uploads cannot take the server's memory."""

    def __init__(self, total: int):
        self.total, self.used = total, 0

    def take(self, nbytes: int) -> bool:
        if self.used + nbytes > self.total:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used -= nbytes
