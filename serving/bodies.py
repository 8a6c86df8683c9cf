"""Reading request bodies: JSON (off the event loop), base64 and data URLs, the image or PDF of an
/encode whichever way it came (multipart, raw, JSON). Every failure is an ApiError (a 4xx)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from ocr_latent.serving.http_errors import ApiError, validation_message
from ocr_latent.serving.schemas import EncodeRequest


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


async def read_image_bytes(request: Request, max_body_bytes: int) -> bytes:
    """The image's (or PDF's) bytes, whichever way they came: multipart, raw, or base64 in JSON."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        async with request.form(max_files=4, max_fields=16, max_part_size=max_body_bytes) as form:
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
