"""ocr-latent HTTP service: page image -> 4096 four-bit codes (/encode), codes -> page text (/decode).

The HTTP face of an engine (`serving.interface.EngineLike`: `serving.engine.Engine` in this process, or
Ray Serve's `RemoteEngine`): the endpoints and the app factory. What they stand on is in `serving/`:
the schemas (`schemas`), reading request bodies (`bodies`), images and PDFs (`documents`), errors as
HTTP answers (`http_errors`), the outermost middleware (`guard`), the settings (`settings`) and the
uvicorn runner (`runner`). The event loop only parses, validates and routes requests; the engine's
thread runs the model and resolves each job's future.

Run with `./serve.sh` (or `ocr-latent serve`, `python server.py`, `uvicorn --factory ocr_latent.server:create_app`);
configuration is by environment variable, see serving/settings.py and README.md.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import concurrent.futures
import copy
import functools
import json
import sys
import threading
import time
import warnings
from typing import Any, Callable, Literal

import numpy as np
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from ocr_latent.architecture import NUM_CODES, PACKED_BYTES
from ocr_latent.client.codesfile import MEDIA_TYPE as CODES_MEDIA_TYPE, CodesFile, CodesFileError, pack, unpack
from ocr_latent.serving.bodies import b64decode, read_image_bytes, read_json, wait_disconnect
from ocr_latent.serving.documents import (DocumentError, OutOfTime, decoded_bytes, image_view,
                                          looks_like_pdf, probe_image, render_pdf, settings_limits, view_bytes)
from ocr_latent.serving.engine import DecodeResult, Engine, EngineConfig
from ocr_latent.serving.errors import EngineError
from ocr_latent.serving.guard import STARTED, STATUS, DecodeBudget, Guard
from ocr_latent.serving.http_errors import (ApiError, ClientGone, document_error, http_error, install_handlers,
                                            validation_message)
from ocr_latent.serving.interface import EngineLike, JobLike
from ocr_latent.serving.workers import WorkerPool
from ocr_latent.serving.schemas import (IGNORE_EOS_DOC, MAX_TOKENS, MIN_CONFIDENCE_DOC, MIN_TOKENS_DOC, PAGES_PATTERN, SSE_EVENT_SCHEMA,
                                        DecodePagesResponse, DecodeRequest, DecodeResponse, EncodePagesResponse, EncodeRequest,
                                        EncodeResponse, ErrorResponse, HealthResponse, LoadingResponse, PageCodes, PageText,
                                        decode_request_schema)
from ocr_latent.serving.settings import Settings, settings as read_settings
from ocr_latent.serving.streaming import TextFeed
from ocr_latent.serving.telemetry import Metrics

router = APIRouter()
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 413, 415, 422, 503, 504)}


def exit_at_once(message: str) -> None:
    """Outside the runner (e.g. `uvicorn --factory ocr_latent.server:create_app`): a server without a model
    must not linger."""
    import os
    sys.stderr.flush()
    os._exit(1)


def create_app(settings: Settings | None = None, engine_factory: Callable[..., EngineLike] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """`engine_factory(config, metrics, on_fatal)` makes the engine the endpoints use (default: `Engine`, in
    this process); serving/ray_serve.py passes one whose jobs run on Ray Serve replicas. `on_fatal(message)`:
    what to do when the model cannot be loaded (default: exit at once; the runner stops uvicorn)."""
    s = settings or read_settings()
    config, metrics = EngineConfig.from_settings(s), Metrics()
    Image.MAX_IMAGE_PIXELS = s.max_image_pixels  # Pillow's own bomb check; above 2x it raises at open
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we reject those sizes ourselves

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = (engine_factory or Engine)(config, metrics, on_fatal or exit_at_once).start()
        app.state.engine = engine
        # the image workers start beside the model, so that the first uploads find them ready
        workers = asyncio.get_running_loop().run_in_executor(app.state.image_threads, app.state.image_pool.start)
        workers.add_done_callback(lambda f: f.cancelled() or f.exception())  # else the first upload starts them
        try:
            yield
        finally:
            app.state.pdf_pool.close()
            app.state.image_pool.close()
            await asyncio.to_thread(engine.stop)

    # redirect_slashes off: "/decode/" is a 404, not a redirect built from the client's Host header
    app = FastAPI(title="ocr-latent", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="Document image -> 4096 four-bit codes -> page text (DeepSeek-OCR architecture).")
    app.state.settings, app.state.engine_config, app.state.metrics = s, config, metrics
    app.state.api_key = s.bearer_key()
    # PDFs render and images decode in worker processes (serving/workers.py), waited for on threads of their own
    # (never the threads that parse JSON); PDFs beyond PDF_WORKERS + PDF_QUEUE are refused
    app.state.pdf_pool = WorkerPool(settings_limits(s))
    app.state.pdf_threads = concurrent.futures.ThreadPoolExecutor(s.pdf_workers + s.pdf_queue, thread_name_prefix="pdf")
    app.state.pdfs = 0  # in the server's hands, rendering or waiting to
    app.state.image_pool = WorkerPool(settings_limits(s, "image"))
    app.state.image_threads = concurrent.futures.ThreadPoolExecutor(2 * s.image_workers, thread_name_prefix="image")
    # pages hold memory within a budget from their decoding until the engine is done with them (IMAGE_MEMORY_BYTES)
    app.state.decode_budget = DecodeBudget(s.image_memory_bytes, s.max_queue, s.request_timeout_s, s.retry_after_s)
    install_handlers(app)
    app.include_router(router)
    app.openapi = live_openapi(app)
    app.add_middleware(Guard, settings=s, api_key=app.state.api_key, metrics=metrics)
    return app


# ----------------------------------------------------------------------------- what the endpoints share
def engine_of(request: Request) -> EngineLike:
    """The engine, once ready (checked before the body is read: a loading server answers at once)."""
    engine: EngineLike = request.app.state.engine
    try:
        engine.check_ready()
    except EngineError as e:
        raise http_error(e) from None
    return engine


def request_deadline(request: Request) -> float:
    """When the request must be answered by (time.monotonic()): REQUEST_TIMEOUT_S from the arrival of its head,
    reading, decoding, rendering and queueing included."""
    return request.scope.get(STARTED, time.monotonic()) + request.app.state.settings.request_timeout_s


def retrieve(future: asyncio.Future) -> None:
    """Done-callback of work nobody waits for any more: its exception is retrieved (no 'never retrieved' warning)."""
    future.cancelled() or future.exception()


async def unless_gone(request: Request, work: asyncio.Future, until: float | None, stop: Callable[[], None]):
    """The one cancellation helper of the endpoints: `work`'s result, unless the client hangs up first
    (ClientGone) or time.monotonic() reaches `until` (TimeoutError); either way `stop()` is called to stop
    the work (a worker killed, jobs cancelled), and whatever it ends with is retrieved."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        timeout = None if until is None else max(0.0, until - time.monotonic())
        await asyncio.wait({work, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left, the time is up, or this task was cancelled
            stop()
            work.add_done_callback(retrieve)
    if work.done():
        return work.result()
    if gone.done():
        raise ClientGone()
    raise TimeoutError()


async def run_jobs(request: Request, engine: EngineLike, submits: list[Callable[[], JobLike]],
                   jobs: list[JobLike] | None = None) -> list[Any]:
    """Submit jobs (each `submit` one of the engine's submitting calls) and wait for all of them, for
    the client (a hang-up cancels them) and for their deadline. One refused job refuses the request.
    `jobs`: a list to hold the jobs (what they tell beside their results, e.g. an encode's fidelity)."""
    jobs = [] if jobs is None else jobs
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

    async def all_done():  # the first failure fails the request as a whole
        for result in asyncio.as_completed(results):
            await result
    try:
        await unless_gone(request, asyncio.ensure_future(all_done()), max(job.deadline for job in jobs),
                          lambda: None)
    except TimeoutError:
        raise http_error(engine.deadline_error()) from None
    except EngineError as e:
        raise http_error(e) from None
    finally:
        for job, result in zip(jobs, results):
            if not result.done():  # timed out, client gone, a sibling failed, or this task cancelled
                engine.cancel(job)
                result.add_done_callback(retrieve)
    return [r.result() for r in results]


async def render_pages(request: Request, data: bytes, mode: str, pages: str | None):
    """A PDF's pages from the app's PDF workers, waited for on the app's own threads (renders queued there
    never hold the threads that parse JSON). At most PDF_WORKERS + PDF_QUEUE PDFs are in the server's hands
    (beyond: a 503); the render must end within the request's deadline (a 504) and within PDF_RENDER_BUDGET_S
    (a 413): either way, or when the client hangs up, its worker is killed (and replaced on the next render),
    and no job reaches the engine."""
    state, s, cancel = request.app.state, request.app.state.settings, threading.Event()
    if state.pdfs >= s.pdf_workers + s.pdf_queue:
        raise ApiError(503, "overloaded", f"{state.pdfs} PDFs are being rendered or wait for a renderer (PDF_WORKERS + "
                                          f"PDF_QUEUE); retry shortly", {"Retry-After": str(s.retry_after_s)})
    deadline, budget = request_deadline(request), time.monotonic() + s.pdf_render_budget_s
    until = min(deadline, budget)
    state.pdfs += 1
    try:
        work = asyncio.get_running_loop().run_in_executor(state.pdf_threads, functools.partial(
            render_pdf, data, mode, pages, s.max_pages, cancel=cancel, pool=state.pdf_pool, until=until))
        return await unless_gone(request, work, until + 1.0, cancel.set)
    except (OutOfTime, TimeoutError):
        cancel.set()
        if budget < deadline:
            raise ApiError(413, "document_too_complex", f"the PDF is too complex: its pages took longer than "
                                                        f"{s.pdf_render_budget_s:g} s to render in all "
                                                        f"(PDF_RENDER_BUDGET_S), so the rendering was stopped; send "
                                                        f"fewer pages (pages=), or a simpler PDF") from None
        raise http_error(request.app.state.engine.deadline_error()) from None
    finally:
        state.pdfs -= 1


async def view_within_budget(request: Request, data: bytes, mode: str, stack: contextlib.AsyncExitStack):
    """An uploaded image -> the page the encoder makes its view of (no larger than the view), decoded by an
    image worker (serving/workers.py: a deadline, a memory limit, killed when the client leaves or the request's
    deadline passes) once what decoding it holds (judged from its header) fits the app's budget
    (IMAGE_MEMORY_BYTES; else it waits, or gets a 503). The budget is then held for that page alone, until the
    request ends (`stack`): until the engine is done with it."""
    s, state, cancel = request.app.state.settings, request.app.state, threading.Event()
    image = await asyncio.to_thread(probe_image, data, s.max_image_pixels, mode)  # its header: cheap, bounded
    hold = await stack.enter_async_context(state.decode_budget.hold(decoded_bytes(image, mode)))
    image.close()
    until = request_deadline(request)
    work = asyncio.get_running_loop().run_in_executor(state.image_threads, functools.partial(
        image_view, data, mode, s.max_image_pixels, state.image_pool, cancel, until))
    try:
        view = await unless_gone(request, work, until + 1.0, cancel.set)
    except (OutOfTime, TimeoutError):
        raise http_error(request.app.state.engine.deadline_error()) from None
    hold.shrink(view.width * view.height * 4)
    return view


def default_max_tokens(engine: EngineLike, prompt: str) -> int:
    """4096, or what a cache slot holds beyond the prompt when that is less (KV_CACHE_TOKENS)."""
    most = engine.max_new_tokens(prompt) if prompt in engine.info.prompts else None
    return 4096 if most is None else max(1, min(4096, most))


def check_quantizer(engine: EngineLike, fingerprint: str | None) -> None:
    own = engine.info.quantizer_fingerprint
    if fingerprint is not None and fingerprint != own:
        raise ApiError(409, "quantizer_mismatch",
                       f"these codes were made by quantizer {fingerprint}; this server decodes codes of quantizer "
                       f"{own} and would read other codes as wrong text: decode them on the server that made them "
                       f"(or encode the page again here)")


# ----------------------------------------------------------------------------- /health
HEALTH_ANSWERS = {503: {"model": LoadingResponse, "description": "loading (or failed to load)"}}


@router.head("/health", response_model=HealthResponse, responses=HEALTH_ANSWERS, operation_id="health_head")
@router.get("/health", response_model=HealthResponse, responses=HEALTH_ANSWERS, operation_id="health")
async def health(request: Request):  # HEAD too: load balancers use it
    engine: EngineLike = request.app.state.engine
    if engine.ready:
        i = engine.info
        return HealthResponse(status="ok", model=i.label, revision=i.revision, device=i.device,
                              quantizer=i.quantizer_fingerprint, mode=i.mode)
    if engine.failed:
        return JSONResponse({"status": "failed", "error": {"type": "startup_failed",
                                                           "message": engine.failed.splitlines()[0]}},
                            status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503,
                        headers={"Retry-After": str(request.app.state.engine_config.loading_retry_after_s)})


# ----------------------------------------------------------------------------- /encode
BINARY = {"schema": {"type": "string", "format": "binary"}}
ENCODE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": EncodeRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
        "image": {"type": "string", "format": "binary", "description": "the image or PDF file"}}}},
    **{t: BINARY for t in ("image/png", "image/jpeg", "image/webp", "image/tiff", "image/bmp", "application/pdf",
                           "application/octet-stream")}}}}
ENCODE_ANSWERS = {**ERRORS, 200: {"content": {CODES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                                  "description": "JSON; or with format=olc (or that Accept), a codes file"}}


@router.post("/encode", response_model=EncodeResponse | EncodePagesResponse, responses=ENCODE_ANSWERS,
             openapi_extra=ENCODE_BODY)
async def encode(request: Request,
                 format: Literal["json", "olc"] | None = Query(None, description=(
                     "json: codes in JSON (the default); olc: a codes file (docs/codes-file.md), as the Accept "
                     f"header {CODES_MEDIA_TYPE} also asks")),
                 pages: str | None = Query(None, max_length=200, pattern=PAGES_PATTERN, description=(
                     "PDFs only: the pages to encode, 1-based, e.g. 1-3,5 or 2- (default all, at most MAX_PAGES)"))):
    """A page image -> 4096 codes; a PDF -> 4096 codes per page. The image or PDF comes as JSON
    {"image": base64 or data URL}, as multipart field `image`, or as the raw bytes with their
    Content-Type. The answer names the quantizer that made the codes."""
    engine, s = engine_of(request), request.app.state.settings
    as_file = format == "olc" or format is None and CODES_MEDIA_TYPE in request.headers.get("accept", "")
    data = await read_image_bytes(request, s.max_body_bytes)
    info, is_pdf = engine.info, looks_like_pdf(data)
    async with contextlib.AsyncExitStack() as held:  # the pages' share of IMAGE_MEMORY_BYTES, until encoded
        try:
            if is_pdf:
                rendered = await render_pages(request, data, info.mode, pages)
                numbers, images = [n for n, _ in rendered], [im for _, im in rendered]
                await held.enter_async_context(request.app.state.decode_budget.hold(len(images) * view_bytes(info.mode)))
            else:
                if pages is not None:
                    raise ApiError(422, "invalid_request", "pages= selects pages of a PDF; this is a single image")
                numbers, images = [1], [await view_within_budget(request, data, info.mode, held)]
        except DocumentError as e:
            raise document_error(e) from None
        del data
        timeout_s = max(0.001, request_deadline(request) - time.monotonic())  # the reading and the wait count
        jobs: list[JobLike] = []
        codes = await run_jobs(request, engine, [lambda im=im: engine.encode(im, timeout_s) for im in images], jobs)
    fidelity = [getattr(job, "fidelity", None) for job in jobs]
    if as_file:  # the fidelity of each page rides in a header: the codes file's format stays as it is
        fidelities = {"X-Fidelity": ",".join(f"{f:.4f}" for f in fidelity)} if None not in fidelity else {}
        return Response(CodesFile(info.quantizer_fingerprint, info.mode, codes).to_bytes(), media_type=CODES_MEDIA_TYPE,
                        headers=fidelities)
    packed = [base64.b64encode(pack(c)).decode() for c in codes]
    if is_pdf:
        return EncodePagesResponse(pages=[PageCodes(page=n, codes=c.tolist(), codes_b64=b, fidelity=f)
                                          for n, c, b, f in zip(numbers, codes, packed, fidelity)],
                                   quantizer=info.quantizer_fingerprint, mode=info.mode)
    return EncodeResponse(codes=codes[0].tolist(), codes_b64=packed[0], quantizer=info.quantizer_fingerprint,
                          mode=info.mode, fidelity=fidelity[0])


# ----------------------------------------------------------------------------- /decode
DECODE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": decode_request_schema()},
    CODES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary",
                                  "description": "a codes file (docs/codes-file.md), as /encode?format=olc returns"}}}}}
DECODE_ANSWERS = {**ERRORS, 409: {"model": ErrorResponse, "description": "codes of another quantizer"},
                  200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                        "description": "JSON; with stream=true, server-sent events"}}


@router.post("/decode", response_model=DecodeResponse | DecodePagesResponse, responses=DECODE_ANSWERS,
             openapi_extra=DECODE_BODY)
async def decode(request: Request,
                 prompt: Literal["free", "markdown"] = Query("free", description="as the JSON field prompt"),
                 max_tokens: int | None = Query(None, ge=1, le=MAX_TOKENS, description="as the JSON field max_tokens"),
                 min_tokens: int | None = Query(None, ge=0, le=MAX_TOKENS, description=MIN_TOKENS_DOC),
                 ignore_eos: bool = Query(False, description=IGNORE_EOS_DOC),
                 min_confidence: float | None = Query(None, ge=0, le=1, description=MIN_CONFIDENCE_DOC)):
    """Codes -> the page's text, greedy. JSON with `codes` or `codes_b64` (one page; `stream` for
    server-sent events), or a codes file as the raw body (every page; refused with a 409 when another
    quantizer made it)."""
    engine = engine_of(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in (CODES_MEDIA_TYPE, "application/octet-stream"):
        lengths = decode_lengths(engine, prompt, max_tokens, min_tokens, ignore_eos, min_confidence)
        return await decode_file(request, engine, await request.body(), prompt, lengths)
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
    lengths = decode_lengths(engine, prompt, req.max_tokens or max_tokens,
                             req.min_tokens if req.min_tokens is not None else min_tokens,
                             req.ignore_eos if req.ignore_eos is not None else ignore_eos,
                             req.min_confidence if req.min_confidence is not None else min_confidence)
    if req.stream:
        return stream_decode(request, engine, codes, prompt, lengths)
    [result] = await run_jobs(request, engine, [lambda: engine.decode(codes, prompt, **lengths, group=request)])
    return DecodeResponse(text=result.text, num_tokens=result.num_tokens, finish_reason=result.finish_reason,
                          prompt_tokens=result.prompt_tokens, confidence=result.confidence)


def decode_lengths(engine: EngineLike, prompt: str, max_tokens: int | None, min_tokens: int | None,
                   ignore_eos: bool, min_confidence: float | None = None) -> dict:
    """engine.decode's max_tokens, min_tokens, ignore_eos and min_confidence: without max_tokens, the default
    raised to min_tokens (the engine refuses what does not fit a slot, naming the field)."""
    min_tokens = min_tokens or 0
    lengths = {"max_tokens": max_tokens or max(default_max_tokens(engine, prompt), min_tokens),
               "min_tokens": min_tokens, "ignore_eos": ignore_eos}
    return lengths if min_confidence is None else {**lengths, "min_confidence": min_confidence}


async def decode_file(request: Request, engine: EngineLike, data: bytes, prompt: str, lengths: dict):
    max_pages = request.app.state.settings.max_pages
    try:
        doc = CodesFile.from_bytes(data)
    except CodesFileError as e:
        raise ApiError(422, "invalid_codes_file", str(e)) from None
    check_quantizer(engine, doc.quantizer)
    if doc.mode != engine.info.mode:  # the quantizer's geometry fixes the mode: a file that disagrees is damaged
        raise ApiError(422, "invalid_codes_file", f"the codes file says its pages were encoded in view mode "
                                                  f"{doc.mode}, but quantizer {doc.quantizer} makes codes of mode "
                                                  f"{engine.info.mode}: the file is damaged")
    if not doc.pages:
        raise ApiError(422, "invalid_codes_file", "the codes file holds no pages")
    if len(doc.pages) > max_pages:
        raise ApiError(413, "payload_too_large", f"the codes file holds {len(doc.pages)} pages; at most "
                                                 f"{max_pages} per request (MAX_PAGES)")
    # one group: the engine shares its slots between requests, not between pages (a 32-page file cannot take them all)
    results = await run_jobs(request, engine, [lambda c=c: engine.decode(c, prompt, **lengths, group=request)
                                               for c in doc.pages])
    return DecodePagesResponse(quantizer=doc.quantizer, pages=[
        PageText(page=i + 1, text=r.text, num_tokens=r.num_tokens, finish_reason=r.finish_reason,
                 prompt_tokens=r.prompt_tokens, confidence=r.confidence) for i, r in enumerate(results)])


def sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def stream_decode(request: Request, engine: EngineLike, codes: np.ndarray, prompt: str,
                  lengths: dict) -> StreamingResponse:
    """Server-sent events: `delta` {text} as the text grows, then `done` {text, num_tokens, prompt_tokens,
    finish_reason} or `error` {error}. A client that leaves cancels the job, and the request is counted 499.
    `lengths`: decode_lengths'."""
    feed = TextFeed()
    try:
        job = engine.decode(codes, prompt, on_text=feed.on_text, **lengths, group=request)
    except EngineError as e:
        raise http_error(e) from None
    except ValueError as e:
        raise ApiError(422, "invalid_request", str(e)) from None

    async def events():
        result = asyncio.wrap_future(job.future)
        try:
            try:
                async for piece in feed.follow(result, job.deadline):
                    yield sse("delta", {"text": piece})
            except TimeoutError:
                raise http_error(engine.deadline_error()) from None
            r: DecodeResult = result.result()
            yield sse("done", {"text": r.text, "num_tokens": r.num_tokens, "prompt_tokens": r.prompt_tokens,
                               "finish_reason": r.finish_reason, "confidence": r.confidence})
        except (EngineError, ApiError) as e:
            err = http_error(e) if isinstance(e, EngineError) else e
            yield sse("error", {"error": {"type": err.type, "message": err.message}})
        finally:
            if not job.future.done():  # the client left (or this server is stopping)
                engine.cancel(job)
                request.scope[STATUS] = 499
            result.add_done_callback(retrieve)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ----------------------------------------------------------------------------- /metrics, the schema
@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def prometheus_metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def live_openapi(app: FastAPI) -> Callable[[], dict]:
    """The schema, with what the loaded model decides once it is ready: the quantizer whose codes
    /decode takes and the prompts its tokenizer can spell (else those are refused while schema-valid)."""
    static_openapi = app.openapi  # FastAPI's, cached

    def openapi() -> dict:
        engine: EngineLike | None = getattr(app.state, "engine", None)
        if engine is None or not engine.ready:
            return static_openapi()
        live, info = copy.deepcopy(static_openapi()), engine.info
        decode_op = live["paths"]["/decode"]["post"]
        decode_op["requestBody"]["content"]["application/json"]["schema"] = decode_request_schema(
            info.quantizer_fingerprint, sorted(info.prompts))
        most = min(MAX_TOKENS, min(engine.max_new_tokens(name) for name in info.prompts))
        for param in decode_op["parameters"]:
            if param["name"] == "prompt":
                param["schema"]["enum"] = sorted(info.prompts)
            if param["name"] in ("max_tokens", "min_tokens"):
                param["schema"]["anyOf"][0]["maximum"] = most
        for name in ("max_tokens", "min_tokens"):
            decode_op["requestBody"]["content"]["application/json"]["schema"]["properties"][name]["maximum"] = most
        return live

    return openapi


def main() -> int:
    """`python server.py`, `ocr-latent serve`: this app on uvicorn (serving/runner.py)."""
    from ocr_latent.serving.runner import run
    return run(create_app)


if __name__ == "__main__":
    sys.exit(main())
