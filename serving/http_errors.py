"""Errors as HTTP answers: `ApiError` (what an endpoint raises), the mapping of engine and document
errors to statuses and types (README "Errors"), and the app's exception handlers."""
from __future__ import annotations

import logging
import time
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ocr_latent.serving.documents import DocumentError
from ocr_latent.serving.errors import Cancelled, DeadlineExceeded, EngineError, Loading, Overloaded, Unavailable

log = logging.getLogger("ocr_latent.server")


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


# what a field that failed its pattern should look like, in words (a message never shows the regex)
PATTERN_HINTS = {"pages": "use page numbers and ranges like 1-3,5 or 2- (1-based)",
                 "quantizer": "a quantizer fingerprint is 16 lowercase hex digits, as /encode and /health give it",
                 "codes_b64": "2,048 bytes as base64"}


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        if e.get("type") == "string_pattern_mismatch":
            field = str(e.get("loc", ("",))[-1])
            msg = PATTERN_HINTS.get(field, "not in the expected format")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts[:5]) + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")


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


def document_error(e: DocumentError) -> ApiError:
    return ApiError(e.status, e.type, str(e))


def install_handlers(app: FastAPI) -> None:
    """Every error an app raises becomes {"error": {"type", "message"}} with its status."""
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
