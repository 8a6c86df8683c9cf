"""A small Python client of the ocr-latent HTTP API (httpx), and what `ocr-latent encode/decode` use.

    from ocr_latent.client import Client
    with Client("http://127.0.0.1:8000") as c:
        doc = c.encode(Path("page.png").read_bytes())      # a CodesFile: pages of codes + the quantizer's fingerprint
        Path("page.olc").write_bytes(doc.to_bytes())
        for page in c.decode(doc):                        # [{"page", "text", "num_tokens", "finish_reason", ...}]
            print(page["text"])
        for piece in c.decode_stream(doc.pages[0], doc.quantizer):   # the text as it is generated
            print(piece, end="", flush=True)

Refusals come back as `ApiError` (HTTP status, the server's error type and message); a server that
cannot be reached as `Unreachable`. A busy or loading server (503 with Retry-After) is retried a few times.
"""
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np

from ocr_latent.client.codesfile import MEDIA_TYPE, CodesFile, pack

DEFAULT_URL = "http://127.0.0.1:8000"


def length_options(min_tokens: int, ignore_eos: bool) -> dict:
    """min_tokens and ignore_eos as /decode's JSON fields or query parameters (httpx writes True as true), sent
    only when asked for: a server from before them refuses unknown JSON fields."""
    return {**({"min_tokens": min_tokens} if min_tokens else {}), **({"ignore_eos": True} if ignore_eos else {})}


class ClientError(Exception):
    pass


class Unreachable(ClientError):
    pass


class ApiError(ClientError):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message = status, type, message


class Client:
    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0, retries: int = 5):
        if api_key and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
            raise ClientError("the API key (--api-key or OCR_LATENT_API_KEY) must be printable ASCII without spaces, "
                              "as the server's API_KEY is: an HTTP header cannot carry this one; check that it was "
                              "copied whole")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url, self.retries = url.rstrip("/"), retries
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ the API
    def health(self) -> dict:
        return self._send("GET", "/health", retry=False).json()

    def encode(self, data: bytes, pages: str | None = None, fidelity: list[float] | None = None) -> CodesFile:
        """An image's or a PDF's bytes -> its codes (one page per image, one per selected PDF page). `fidelity`,
        when given, receives each page's fidelity (0..1: how faithfully its codes carry it), where the server
        reports one."""
        params = {"format": "olc", **({"pages": pages} if pages else {})}
        r = self._send("POST", "/encode", params=params, content=data,
                       headers={"Content-Type": "application/octet-stream", "Accept": MEDIA_TYPE})
        if fidelity is not None and r.headers.get("x-fidelity"):
            fidelity.extend(float(f) for f in r.headers["x-fidelity"].split(","))
        return CodesFile.from_bytes(r.content)

    def decode(self, codes: CodesFile, prompt: str = "free", max_tokens: int = 4096, min_tokens: int = 0,
               ignore_eos: bool = False) -> list[dict]:
        """Every page of a codes file -> [{page, text, num_tokens, finish_reason, prompt_tokens}]. The
        server refuses (409) codes of a quantizer other than its own. `min_tokens`: EOS and the repetition
        rule cannot end a page's text sooner; `ignore_eos`: every page runs to max_tokens."""
        r = self._send("POST", "/decode", params={"prompt": prompt, "max_tokens": max_tokens,
                                                  **length_options(min_tokens, ignore_eos)},
                       content=codes.to_bytes(), headers={"Content-Type": MEDIA_TYPE})
        return r.json()["pages"]

    def decode_stream(self, codes: np.ndarray, quantizer: str | None = None, prompt: str = "free",
                      max_tokens: int = 4096, final: dict | None = None, min_tokens: int = 0,
                      ignore_eos: bool = False) -> Iterator[str]:
        """One page's codes -> the pieces of its text as the server generates them. `final`, when given,
        receives the last event's fields (text, num_tokens, prompt_tokens, finish_reason)."""
        body = {"codes_b64": base64.b64encode(pack(codes)).decode(), "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, **({"quantizer": quantizer} if quantizer else {}), **length_options(min_tokens, ignore_eos)}
        for attempt in range(self.retries + 1):
            try:
                with self.http.stream("POST", "/decode", json=body) as r:
                    if self._should_retry(r, attempt):
                        continue
                    self._raise_for_status(r)
                    event = None
                    for line in r.iter_lines():
                        if line.startswith("event:"):
                            event = line[6:].strip()
                        elif line.startswith("data:"):
                            data = json.loads(line[5:])
                            if event == "delta":
                                yield data["text"]
                            elif event == "done":
                                if final is not None:
                                    final.update(data)
                                return
                            elif event == "error":
                                raise ApiError(r.status_code, data["error"]["type"], data["error"]["message"])
                    raise ClientError("the server closed the stream before its last event")
            except httpx.TransportError as e:
                raise Unreachable(f"lost the server at {self.url}: {e} (is it running? ./serve.sh starts one)") from None

    # ------------------------------------------------------------------ plumbing
    def _send(self, method: str, path: str, retry: bool = True, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1 if retry else 1):
            try:
                r = self.http.request(method, path, **kw)
            except httpx.TransportError as e:
                raise Unreachable(f"cannot reach the server at {self.url}: {e} (is it running? ./serve.sh "
                                  "starts one; --url or OCR_LATENT_URL names another)") from None
            if retry and self._should_retry(r, attempt):
                continue
            self._raise_for_status(r)
            return r
        raise AssertionError("unreachable")

    def _should_retry(self, r: httpx.Response, attempt: int) -> bool:
        """A 503 with Retry-After (loading, or its queue full) is worth waiting for, a few times."""
        if r.status_code != 503 or attempt >= self.retries or "retry-after" not in r.headers:
            return False
        try:
            wait = min(30.0, max(0.1, float(r.headers["retry-after"])))
        except ValueError:
            return False
        r.read()
        time.sleep(wait)
        return True

    @staticmethod
    def _raise_for_status(r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        r.read()
        try:
            err = r.json()["error"]
            raise ApiError(r.status_code, err["type"], err["message"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(r.status_code, "http_error", r.text[:500] or r.reason_phrase) from None
