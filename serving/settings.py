"""Every environment variable the project reads, in one typed object read once (README "Configuration").

`settings()` reads the environment the first time it is called and keeps the answer. A blank value is
the default; a bad one ends the program with a one-line message naming the variable (the same messages
as before there was this module), not a validation traceback. Nothing else reads `os.environ`
(`environment` hands variables on to Ray replicas as they are).
"""
from __future__ import annotations

import functools
import os

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import BaseSettings

from ocr_latent.architecture import DTYPE_NAMES


# field -> (type, minimum) for the numbers; parsed here so that a bad value gets the old message
NUMBERS = {
    "port": (int, 0), "torch_threads": (int, 1), "encode_batch_window_ms": (float, 0), "encode_max_batch": (int, 1),
    "decode_slots": (int, 1), "kv_cache_tokens": (int, 2), "max_queue": (int, 1), "request_timeout_s": (float, 0.001),
    "retry_after_s": (int, 0), "shutdown_drain_s": (float, 0), "max_body_bytes": (int, 1), "max_image_pixels": (int, 1),
    "max_pages": (int, 1), "image_memory_bytes": (int, 1 << 20),
    "header_timeout_s": (float, 0.1), "max_connections": (int, 1), "replica_cpus": (float, 0),
    "encode_gpus": (float, 0), "decode_gpus": (float, 0), "ingress_cpus": (float, 0), "ray_num_cpus": (int, 1),
    "ray_object_store_bytes": (int, 80_000_000), "pdf_workers": (int, 1), "pdf_memory_bytes": (int, 64 << 20),
    "pdf_deadline_s": (float, 0.1), "test_load_delay_s": (float, 0), "test_step_delay_s": (float, 0),
    "body_timeout_s": (float, 0.1), "body_memory_bytes": (int, 1 << 20), "max_connections_per_client": (int, 1),
    "image_workers": (int, 1), "image_worker_memory_bytes": (int, 128 << 20), "image_deadline_s": (float, 0.1),
    "pdf_queue": (int, 0), "pdf_render_budget_s": (float, 0.1),
}
FLAGS = ("compile",)  # 1/0, true/false, yes/no
SWITCHES = ("access_log", "verify_pin")  # exactly "1" turns them on


def env(name: str, default=None, description: str = ""):
    return Field(default, validation_alias=name, description=description)


class Settings(BaseSettings):
    """The service's settings; each field's alias is its environment variable."""
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True, case_sensitive=True)

    # where and for whom (server.py, the uvicorn runner)
    host: str = env("HOST", "127.0.0.1")
    port: int = env("PORT", 8000)
    api_key: str | None = env("API_KEY")
    api_key_file: str | None = env("API_KEY_FILE")
    backend: str = env("BACKEND", "local", "local (one process) or ray (Ray Serve)")
    # the model (engine)
    model_dir: str | None = env("MODEL_DIR")
    quantizer: str | None = env("QUANTIZER")
    verify_pin: bool = env("VERIFY_PIN", False)
    device: str = env("DEVICE", "cpu")
    dtype: str | None = env("DTYPE", None, "float32 on a CPU, else bf16")
    prefill_dtype: str | None = env("PREFILL_DTYPE")
    torch_threads: int | None = env("TORCH_THREADS")
    # the engine's batching and limits
    encode_batch_window_ms: float = env("ENCODE_BATCH_WINDOW_MS", 5.0)
    encode_max_batch: int = env("ENCODE_MAX_BATCH", 8)
    decode_slots: int = env("DECODE_SLOTS", 16)
    kv_cache_tokens: int | None = env("KV_CACHE_TOKENS")
    compile: bool = env("COMPILE", False)
    max_queue: int = env("MAX_QUEUE", 64)
    request_timeout_s: float = env("REQUEST_TIMEOUT_S", 120.0)
    retry_after_s: int = env("RETRY_AFTER_S", 1)
    shutdown_drain_s: float = env("SHUTDOWN_DRAIN_S", 8.0)
    # HTTP limits
    max_body_bytes: int = env("MAX_BODY_BYTES", 20_000_000)
    max_image_pixels: int = env("MAX_IMAGE_PIXELS", 40_000_000)
    max_pages: int = env("MAX_PAGES", 32)
    # what images being decoded at once may hold, judged from their headers (serving/guard.py DecodeBudget)
    image_memory_bytes: int = env("IMAGE_MEMORY_BYTES", 256 << 20)
    # reading requests (serving/runner.py, serving/guard.py): the head's deadline, then the body's; bodies held at
    # once; open connections in all and from one client address
    header_timeout_s: float = env("HEADER_TIMEOUT_S", 10.0)
    body_timeout_s: float = env("BODY_TIMEOUT_S", 30.0)
    body_memory_bytes: int = env("BODY_MEMORY_BYTES", 256 << 20)
    max_connections: int = env("MAX_CONNECTIONS", 1000)
    max_connections_per_client: int = env("MAX_CONNECTIONS_PER_CLIENT", 64)
    # image decoding (serving/workers.py): worker processes, each's address space, each decode's deadline
    image_workers: int = env("IMAGE_WORKERS", 2)
    image_worker_memory_bytes: int = env("IMAGE_WORKER_MEMORY_BYTES", 1 << 30)
    image_deadline_s: float = env("IMAGE_DEADLINE_S", 10.0)
    # PDF rendering (serving/workers.py): worker processes, each's address space, each page's deadline; PDFs that
    # may wait for a worker; what one request's pages may take to render in all
    pdf_workers: int = env("PDF_WORKERS", 2)
    pdf_memory_bytes: int = env("PDF_MEMORY_BYTES", 512 << 20)
    pdf_deadline_s: float = env("PDF_DEADLINE_S", 10.0)
    pdf_queue: int = env("PDF_QUEUE", 4)
    pdf_render_budget_s: float = env("PDF_RENDER_BUDGET_S", 60.0)
    # logs
    log_level: str = env("LOG_LEVEL", "info")
    access_log: bool = env("ACCESS_LOG", False)
    log_format: str = env("LOG_FORMAT", "text")
    # Ray (serving/ray_serve.py, serving/bulk.py)
    encode_replicas: str = env("ENCODE_REPLICAS", "1")
    decode_replicas: str = env("DECODE_REPLICAS", "1")
    replica_cpus: float | None = env("REPLICA_CPUS", None, "default TORCH_THREADS, else 1")
    encode_gpus: float = env("ENCODE_GPUS", 0.25)
    decode_gpus: float = env("DECODE_GPUS", 0.75)
    ingress_cpus: float = env("INGRESS_CPUS", 0.0)
    ray_address: str | None = env("RAY_ADDRESS")
    ray_num_cpus: int | None = env("RAY_NUM_CPUS")
    ray_object_store_bytes: int | None = env("RAY_OBJECT_STORE_BYTES")
    # the client side (ocr-latent encode/decode/health)
    url: str = env("OCR_LATENT_URL", "http://127.0.0.1:8000")
    client_api_key: str | None = env("OCR_LATENT_API_KEY")
    # tests only: a slow load, a slow model
    test_load_delay_s: float = env("OCR_LATENT_TEST_LOAD_DELAY_S", 0.0)
    test_step_delay_s: float = env("OCR_LATENT_TEST_STEP_DELAY_S", 0.0)

    @field_validator("*", mode="before")
    @classmethod
    def _parse(cls, value, info: ValidationInfo):
        if not isinstance(value, str):
            return value  # set in code, not read from the environment
        name, raw = cls.model_fields[info.field_name].validation_alias, value.strip()
        if not raw:
            raise PydanticUseDefault()
        field = info.field_name
        if field in NUMBERS:
            kind, minimum = NUMBERS[field]
            try:
                number = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            if number < minimum:
                raise ValueError(f"{name}={raw!r} must be >= {minimum}")
            return number
        if field in FLAGS:
            raw = raw.lower()
            if raw not in ("0", "1", "false", "true", "no", "yes"):
                raise ValueError(f"{name}={raw!r}: use 1 or 0")
            return raw in ("1", "true", "yes")
        if field in SWITCHES:
            return raw == "1"
        if field in ("dtype", "prefill_dtype"):
            if raw.lower() not in DTYPE_NAMES:
                raise ValueError(f"{name}={raw.lower()!r}: use float32, bf16 or fp16")
            return raw.lower()
        return raw

    @property
    def model_dtype(self) -> str:
        """DTYPE, else bf16 on accelerators (DeepSeek-OCR's own serving dtype, and the MoE's grouped-GEMM path)."""
        return self.dtype or ("float32" if self.device == "cpu" else "bf16")

    def bearer_key(self) -> str | None:
        """API_KEY, else the contents of API_KEY_FILE (an unreadable or empty file, or a key that an HTTP
        header cannot carry, ends the program)."""
        if self.api_key is not None or not self.api_key_file:
            return check_key(self.api_key, "API_KEY")
        try:
            key = open(self.api_key_file).read().strip() or None
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"API_KEY_FILE={self.api_key_file!r}: {e}") from None
        if key is None:
            raise SystemExit(f"API_KEY_FILE={self.api_key_file!r} is empty")
        return check_key(key, f"the key in API_KEY_FILE={self.api_key_file!r}")


def check_key(key: str | None, what: str) -> str | None:
    """An API key as a Bearer token carries it: printable ASCII without spaces (RFC 6750's token68 is
    narrower still); anything else could never be sent in an Authorization header. SystemExit naming `what`."""
    if key is not None and not (key.isascii() and key.isprintable() and " " not in key):
        bad = next(c for c in key if not (c.isascii() and c.isprintable()) or c == " ")
        raise SystemExit(f"{what} holds {'a space' if bad == ' ' else f'the character U+{ord(bad):04X}'}: an API key "
                         f"must be printable ASCII without spaces (an HTTP header cannot carry it otherwise); "
                         f"choose another key, e.g. from `python3 -c \"import secrets; print(secrets.token_urlsafe(32))\"`")
    return key


def read_settings() -> Settings:
    """The environment, now, as Settings; a bad value ends the program with its message."""
    try:
        return Settings()
    except ValidationError as e:
        raise SystemExit(e.errors()[0]["msg"].removeprefix("Value error, ")) from None


@functools.cache
def settings() -> Settings:
    """The environment as Settings, read on the first call."""
    return read_settings()


def variables() -> list[str]:
    """Every environment variable the project reads."""
    return [f.validation_alias for f in Settings.model_fields.values()]


def environment(names) -> dict[str, str]:
    """The variables among `names` that are set, as they are: what Ray replicas are given to read themselves."""
    return {k: os.environ[k] for k in names if k in os.environ}
