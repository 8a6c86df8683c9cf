"""What a front end (server.py's endpoints, bulk jobs) needs of an engine: `EngineLike`, implemented by
the in-process `engine.Engine` and by Ray Serve's `ray_serve.RemoteEngine`; `ServiceInfo`, what a loaded
engine serves; `EngineState`, the readiness and deadlines both share."""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ocr_latent.serving.errors import DeadlineExceeded, Loading, Unavailable


@dataclass(frozen=True)
class ServiceInfo:
    """What a loaded engine serves (/health, the live OpenAPI schema, codes files)."""
    label: str
    revision: str
    device: str
    quantizer_fingerprint: str
    mode: str
    prompts: tuple[str, ...]  # the prompts its tokenizer can spell


class JobLike(Protocol):
    deadline: float
    future: concurrent.futures.Future


class EngineLike(Protocol):
    ready: bool
    failed: str | None

    @property
    def info(self) -> ServiceInfo | None: ...
    def start(self) -> "EngineLike": ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def drain(self, seconds: float) -> None: ...
    def check_ready(self) -> None: ...
    def max_new_tokens(self, prompt: str = "free") -> int: ...
    def encode(self, image, timeout_s: float | None = None) -> JobLike: ...
    def decode(self, codes: np.ndarray, prompt: str = "free", max_tokens: int = 4096, timeout_s: float | None = None,
               on_text: Callable[[str], None] | None = None, min_tokens: int = 0,
               ignore_eos: bool = False, group: object = None, min_confidence: float | None = None) -> JobLike: ...
    def cancel(self, job: JobLike) -> None: ...
    def deadline_error(self) -> DeadlineExceeded: ...


def check_lengths(max_tokens: int, min_tokens: int, most: int, slot: str) -> None:
    """Refuse (ValueError: a 422) what no cache slot could honour: `most` is what one holds beyond the page and
    prompt, `slot` says what bounds it. max_tokens' own range (1..8192) is the schema's."""
    if min_tokens < 0:
        raise ValueError(f"min_tokens={min_tokens}: give 0 or more")
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens={min_tokens} is more than max_tokens={max_tokens}: a decode cannot generate "
                         f"more tokens than max_tokens; raise max_tokens or lower min_tokens")
    for name, n in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if n > most:
            raise ValueError(f"{name}={n} does not fit: {slot}; at most {most}")


class EngineState:
    """Readiness and deadlines, as every engine reports them (`s`: its EngineConfig)."""
    ready: bool = False
    failed: str | None = None

    def check_ready(self) -> None:
        """Raises Loading while loading, Unavailable when loading failed."""
        if not self.ready:
            if self.failed:
                raise Unavailable(f"the model failed to load: {self.failed.splitlines()[0]}")
            raise Loading("the model is still loading", self.s.loading_retry_after_s)

    @property
    def prompts(self) -> tuple[str, ...]:
        return self.info.prompts if self.info is not None else ()

    def deadline(self, timeout_s: float | None = None) -> float:
        return time.monotonic() + (self.s.request_timeout_s if timeout_s is None else timeout_s)

    def deadline_error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"the request did not finish within {self.s.request_timeout_s:g}s (REQUEST_TIMEOUT_S)")
