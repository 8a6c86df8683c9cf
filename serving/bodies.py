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


JSON_TYPES = ("application/json", "", "application/x-www-form-urlencoded")  # the last: what curl -d sends by default


def looks_like_file(data: bytes) -> bool:
    """Whether bytes begin as an image or a PDF that /encode reads (whatever Content-Type they came with)."""
    from ocr_latent.serving.documents import IMAGE_SIGNATURES, looks_like_pdf
    return data.startswith(IMAGE_SIGNATURES) or data[:4] == b"RIFF" and data[8:12] == b"WEBP" or looks_like_pdf(data)


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
    if ctype not in JSON_TYPES and not ctype.endswith("+json"):
        data = await request.body()
        if data.lstrip()[:1] not in (b"{", b"[") and data:  # not JSON: a file sent with another type, or nothing usable
            if looks_like_file(data):
                return data
            raise ApiError(415, "unsupported_media_type", f"the body is {ctype} and neither an image, a PDF nor JSON: send "
                                                          f"the file's bytes with its type (e.g. Content-Type: image/png), "
                                                          f"as multipart field 'image', or JSON {{\"image\": base64}}")
        body = await asyncio.to_thread(parse_json, data)
    else:  # JSON, or curl -d's default form type
        body = await read_json(request)
    try:
        req = EncodeRequest.model_validate(body)
    except ValidationError as e:
        raise ApiError(422, "invalid_request", validation_message(e)) from None
    return image_bytes_from_string(req.image)
