"""The inference engine: one thread that owns the model and batches the work given to it. No HTTP here:
the HTTP face (server.py), benchmarks and other front-ends submit typed jobs and wait on their futures.

The worker is a dynamic micro-batcher:
  * encode jobs that arrive within `encode_batch_window_ms` of each other (up to `encode_max_batch`)
    go through the towers as one batch;
  * decode jobs join a running `generation.Generator` (continuous batching, `decode_slots` sequences in
    one batched KV cache) at the next step boundary and leave it as soon as they finish. Free slots go
    by fair turns, not first come first served: a request's jobs share a `group`, and the group with
    the fewest sequences running goes first, while the last few free slots are kept for requests with
    none running (`Engine._fair_turn`), so that large files share the slots and a lone page is not
    queued behind them;
  * each turn of the loop runs at most one encode batch, admits waiting decodes into free slots (one
    batched prefill) and runs one decode step, so neither kind starves the other.
Jobs waiting for the worker (not yet in a batch) form a bounded queue (`max_queue`): submitting to a
full one raises `Overloaded`, and so does a decode that could only time out waiting, every slot it
could take being held by sequences that cannot finish before its deadline (`Engine._refuse_a_certain_timeout`).
A job not done by its deadline fails with `DeadlineExceeded`; a cancelled job is dropped from the queue
or the running batch.

Every job carries a `concurrent.futures.Future`, resolved on the worker thread with the result or a
domain error (`EngineError` subclasses): asyncio callers wrap it (`asyncio.wrap_future`), threads
call `.result()`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from PIL import Image

from ocr_latent.architecture import MAX_LEVEL, NUM_CODES
from ocr_latent.serving.errors import (Cancelled, DeadlineExceeded, EngineError, Loading, ModelFailure,  # noqa: F401
                                       Overloaded, Unavailable)
from ocr_latent.serving.interface import EngineState, ServiceInfo, check_lengths
from ocr_latent.serving.settings import Settings, settings
from ocr_latent.serving.telemetry import Metrics

log = logging.getLogger("ocr_latent.engine")


EARLY_STOP_TOKENS, EARLY_STOP_EVERY = 48, 16  # the early stop judges a reading from this many tokens, this often


class StartupError(RuntimeError):
    """A configuration problem found while loading: reported as its message alone."""


# ----------------------------------------------------------------------------- configuration
@dataclass
class EngineConfig:
    """What the engine needs: a typed part of serving/settings.py's Settings (see README "Configuration")."""
    model_dir: str | None = None  # MODEL_DIR: original-layout DeepSeek-OCR dir; unset = embedded nano
    quantizer: str | None = None  # QUANTIZER: quantizer .safetensors; unset = the base's default
    device: str = "cpu"  # DEVICE
    dtype: str = "float32"  # DTYPE: float32 | bf16 | fp16 (default bf16 when DEVICE is not cpu)
    prefill_dtype: str | None = None  # PREFILL_DTYPE: the prompts' precision (default: pipeline.default_prefill_dtype)
    verify_pin: bool = False  # VERIFY_PIN=1: MODEL_DIR's sha256 checked against architecture.json
    torch_threads: int | None = None  # TORCH_THREADS
    encode_batch_window_ms: float = 5.0  # ENCODE_BATCH_WINDOW_MS
    encode_max_batch: int = 8  # ENCODE_MAX_BATCH
    decode_slots: int = 16  # DECODE_SLOTS
    kv_cache_tokens: int | None = None  # KV_CACHE_TOKENS: key/value positions allocated at startup for all slots
    compile: bool = False  # COMPILE=1: decode steps through torch.compile, compiled during warm-up
    max_queue: int = 64  # MAX_QUEUE: jobs waiting for the worker (not yet batched)
    request_timeout_s: float = 120.0  # REQUEST_TIMEOUT_S: per-job deadline
    retry_after_s: int = 1  # RETRY_AFTER_S: advice to a caller refused by a full queue
    shutdown_drain_s: float = 8.0  # SHUTDOWN_DRAIN_S: on SIGTERM, how long running work may finish
    loading_retry_after_s: int = 5  # advice while loading or shutting down
    load_delay_s: float = 0.0  # OCR_LATENT_TEST_LOAD_DELAY_S: tests only, widens the loading window
    step_delay_s: float = 0.0  # OCR_LATENT_TEST_STEP_DELAY_S: tests only, a slow model (sleep per decode step)
    warmup_tokens: int = 4

    @classmethod
    def from_settings(cls, s: Settings) -> "EngineConfig":
        return cls(model_dir=s.model_dir, quantizer=s.quantizer, device=s.device, dtype=s.model_dtype,
                   prefill_dtype=s.prefill_dtype, verify_pin=s.verify_pin, torch_threads=s.torch_threads,
                   encode_batch_window_ms=s.encode_batch_window_ms, encode_max_batch=s.encode_max_batch,
                   decode_slots=s.decode_slots, kv_cache_tokens=s.kv_cache_tokens, compile=s.compile,
                   max_queue=s.max_queue, request_timeout_s=s.request_timeout_s, retry_after_s=s.retry_after_s,
                   shutdown_drain_s=s.shutdown_drain_s, load_delay_s=s.test_load_delay_s,
                   step_delay_s=s.test_step_delay_s)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        """From the environment (serving/settings.py, read once)."""
        return cls.from_settings(settings())


# ----------------------------------------------------------------------------- jobs
@dataclass(eq=False, kw_only=True)
class Job:
    deadline: float  # time.monotonic()
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False


@dataclass(eq=False, kw_only=True)
class EncodeJob(Job):
    """A page image (RGB) -> codes uint8 [NUM_CODES]; once done, `fidelity` says how faithfully they carry the
    page (0..1; None without a calibration: serving/confidence.py)."""
    image: Image.Image
    fidelity: float | None = None


@dataclass(eq=False, kw_only=True)
class DecodeJob(Job):
    """Codes uint8 [NUM_CODES] + a prompt name -> DecodeResult. With `on_text`, the text is also handed
    over piece by piece as it is generated (called on the worker thread: it must not block); the
    pieces join into DecodeResult.text. `min_tokens`, `ignore_eos`: as generation.Sequence's. `group`: the
    jobs of one request share one (any object, compared by identity; None: a group of its own), for the
    fair turns at the decode slots (Engine._fair_turn)."""
    codes: np.ndarray
    prompt: str
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    on_text: Callable[[str], None] | None = None
    seq: object = None  # decoder.Sequence while decoding
    stream: "TextStream | None" = None
    prompt_tokens: int = 0
    group: object = None
    min_confidence: float | None = None  # the early stop: see Engine.decode

    @property
    def group_key(self) -> int:
        """Its group's identity: by id, so that any object serves, hashable or not."""
        return id(self if self.group is None else self.group)


@dataclass
class DecodeResult:
    text: str
    num_tokens: int  # tokens of the text, EOS not counted
    finish_reason: str  # stop | length | repetition | low_confidence
    prompt_tokens: int = 0  # the decoder's input positions: image tokens and prompt
    confidence: float | None = None  # how far to trust the text, 0..1 (None without a calibration)


class TextStream:
    """The text of a growing list of tokens, piece by piece, decoding only the last few tokens each time.

    Pieces join into the final (stripped) text: the bytes of a character split across tokens wait for
    the rest of it (a trailing U+FFFD), and whitespace at either end waits to see whether text follows."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.start = self.read = 0  # tokens[start:read] decode to the end of `raw`, as context for what follows
        self.raw, self.sent = "", 0

    def feed(self, tokens: list[int]) -> str:
        before, now = self.decode(tokens[self.start:self.read]), self.decode(tokens[self.start:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.raw += now[len(before):]
            self.start, self.read = self.read, len(tokens)
        return self._take(self.raw.strip())

    def finish(self, text: str) -> str:
        """The rest of the final text (as the pipeline detokenises the whole sequence)."""
        return self._take(text)

    def _take(self, visible: str) -> str:
        piece, self.sent = visible[self.sent:], max(self.sent, len(visible))
        return piece


# ----------------------------------------------------------------------------- the engine
class Engine(EngineState):
    """The one thread that owns the model (see the module docstring). `on_fatal(message)` is called
    from the worker thread when the model cannot be loaded or the worker dies."""

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None, on_fatal=None):
        self.s, self.m, self.on_fatal = config, metrics or Metrics(), on_fatal or (lambda message: None)
        self.cv = threading.Condition()
        self.encodes: deque[EncodeJob] = deque()
        self.decodes: deque[DecodeJob] = deque()
        self.running: list[DecodeJob] = []  # decode jobs whose sequences are in the generator
        self.admitting: list[DecodeJob] = []  # taken from the queue by the worker, not in `running` yet
        # the last free decode slots, which only a group with no sequence running may take (_fair_turn)
        self.reserve = max(1, config.decode_slots // 8)
        self.step_s: float | None = None  # the worker's estimate of a decode step's seconds (_track_step)
        self.pipeline = None
        self.gen = None
        self.ready = False
        self.failed: str | None = None
        self.stopping = False
        self.drain_deadline: float | None = None  # set by drain(): refuse new work, fail what is left then
        self.thread = threading.Thread(target=self._main, name="ocr-latent-engine", daemon=True)

    # -- any thread
    def start(self) -> "Engine":
        self.thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until loaded and warmed up; raises Unavailable when loading failed (Loading on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            if self.failed or deadline is not None and time.monotonic() > deadline:
                self.check_ready()
            time.sleep(0.02)

    def encode(self, image: Image.Image, timeout_s: float | None = None) -> EncodeJob:
        return self.submit(EncodeJob(image=image, deadline=self.deadline(timeout_s)))

    def decode(self, codes: np.ndarray, prompt: str = "free", max_tokens: int = 4096,
               timeout_s: float | None = None, on_text: Callable[[str], None] | None = None,
               min_tokens: int = 0, ignore_eos: bool = False, group: object = None,
               min_confidence: float | None = None) -> DecodeJob:
        """`min_tokens`: EOS and the loop detector cannot end it sooner; `ignore_eos`: nor ever, it runs to
        max_tokens (vLLM's fields, for benchmarks of fixed output lengths). `group`: one object for all the
        jobs of a request (its pages), so that requests, not pages, take turns at the slots (None: the job
        is a request of its own). `min_confidence`: the early stop, off by default: from EARLY_STOP_TOKENS
        tokens on, every EARLY_STOP_EVERY tokens, a reading whose confidence would stay below it even if it
        ended there ends with finish_reason "low_confidence" (its text so far) and frees its slot."""
        self.check_ready()  # the prompts and the cache's size are known once loaded
        if prompt not in self.prompts:
            raise ValueError(f"prompt {prompt!r} is not available for model {self.pipeline.label!r} "
                             f"(available: {', '.join(self.prompts)})")
        check_lengths(max_tokens, min_tokens, self.max_new_tokens(prompt),
                      f"a sequence holds {self.gen.slot_tokens} positions (the model's {self.gen.max_positions}, or "
                      f"KV_CACHE_TOKENS / DECODE_SLOTS) and the page and prompt take {self.pipeline.prompt_length(prompt)}")
        if min_confidence is not None and self.pipeline.calibration is None:
            raise ValueError("min_confidence needs a calibrated quantizer (its .confidence.json, made by `python "
                             "train.py confidence`); this server's has none")
        return self.submit(DecodeJob(codes=codes, prompt=prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                                     ignore_eos=ignore_eos, on_text=on_text, group=group,
                                     min_confidence=min_confidence, deadline=self.deadline(timeout_s)))

    def max_new_tokens(self, prompt: str = "free") -> int:
        """The most tokens a decode with `prompt` may ask for: what a cache slot holds beyond the prompt."""
        return self.gen.slot_tokens - self.pipeline.prompt_length(prompt)

    @property
    def info(self) -> ServiceInfo | None:
        p = self.pipeline
        return None if p is None else ServiceInfo(p.label, p.revision, p.device, p.quantizer_fingerprint, p.mode,
                                                  tuple(p.prompts))

    def submit(self, job: Job) -> Job:
        """Queue a job; raises Loading, Unavailable (failed, shutting down) or Overloaded (queue full, or a
        decode that could only time out waiting for a slot)."""
        with self.cv:
            if self.stopping or self.drain_deadline is not None:
                raise Unavailable("the server is shutting down", self.s.loading_retry_after_s)
            self.check_ready()
            # jobs that the next turn of the worker takes (into free decode slots, into the next
            # encode batch) are not waiting; max_queue bounds the ones behind those
            is_decode = isinstance(job, DecodeJob)
            decodes = sum(not j.cancelled for j in self.decodes) + is_decode
            encodes = len(self.encodes) + (not is_decode)
            waiting = max(0, decodes - self.gen.capacity) + max(0, encodes - self.s.encode_max_batch)
            if waiting > self.s.max_queue:
                raise Overloaded(f"the queue is full ({self.s.max_queue} requests waiting, MAX_QUEUE); retry later",
                                 self.s.retry_after_s)
            if is_decode:
                self._refuse_a_certain_timeout(job)
            (self.decodes if is_decode else self.encodes).append(job)
            self._gauge_queue()
            self.cv.notify()
        return job

    def _refuse_a_certain_timeout(self, job: DecodeJob) -> None:
        """Raise Overloaded (a 503 with Retry-After, now) rather than queue a decode for a certain
        DeadlineExceeded (a 504, at its deadline): when it would wait for a slot (none free that `_fair_turn`
        would give it, counting the jobs already waiting), and every slot it could get is held by a sequence
        that will certainly still be running at its deadline. It can only start once one of those frees,
        and none can before the soonest of their `_certain_s`. Conservative: no refusal without a step-time
        estimate, nor while the worker is admitting jobs (their slots are not visible yet).

        Runs on the caller's thread under `cv`; the worker replaces `running` without it, so this reads
        one snapshot of it, and a sequence in it may have finished since (it then counts as 0 s)."""
        step_s, now = self.step_s, time.monotonic()
        if step_s is None or self.admitting:
            return
        free = self.gen.capacity  # before the snapshot: a slot freed in between shows as a finished sequence
        running = list(self.running)
        if len(running) < self.gen.slots - free:  # a sequence being added right now: of unknown length
            return
        live = [j for j in self.decodes if not j.cancelled and now <= j.deadline]
        turn = self._fair_turn(live + [job], free, self._holding(running))
        if any(j is job for j, _ in turn):
            return  # it takes a slot at the next step
        # a job this turn gives a slot to its group's second or later sequence may yet lose it to a newcomer
        # of a group with none running, of unknown length: its slot may free at once
        held = [self._certain_s(j, step_s, now) for j in running] + \
               [0.0 if holding else self._certain_s(j, step_s, now) for j, holding in turn]
        soonest, left = min(held, default=0.0), job.deadline - now
        if soonest > left:
            retry = max(self.s.retry_after_s, math.ceil(soonest - left))
            raise Overloaded(f"every decode slot this request could take is held by a sequence that cannot finish "
                             f"before the request's deadline, {left:.1f}s away (the first frees in {soonest:.1f}s at "
                             f"the earliest: ignore_eos or min_tokens hold them); queued, it could only time out: "
                             f"retry in {retry}s", retry)

    @staticmethod
    def _certain_s(job: DecodeJob, step_s: float, now: float) -> float:
        """Seconds for which `job` (running, or about to be admitted) will certainly still hold its slot: its
        steps that neither EOS nor the repetition rule can cut short (up to max_tokens with ignore_eos,
        else up to min_tokens) at `step_s` each, and no later than its own deadline (it is reaped then).
        0 once finished or cancelled."""
        seq = job.seq
        if job.cancelled or seq is not None and seq.finish_reason is not None:
            return 0.0
        if seq is None:
            steps = job.max_tokens if job.ignore_eos else job.min_tokens
        else:  # `pending`: a token computed and not read back yet (the generator's overlap on CUDA)
            steps = (seq.max_tokens if seq.ignore_eos else seq.min_tokens) - len(seq.tokens) - seq.pending
        return max(0.0, min(steps * step_s, job.deadline - now))

    def cancel(self, job: Job) -> None:
        """Drop a job (its submitter has gone): from the queue, or from the running batch at the next step."""
        if not job.future.done():
            job.cancelled = True
            with self.cv:
                self.cv.notify()

    def drain(self, seconds: float) -> None:
        """Shutting down: refuse new jobs now, let running ones finish for `seconds`, then fail what is
        left with Unavailable (their callers answer before a server's own shutdown timeout cuts them off)."""
        with self.cv:
            self.drain_deadline = time.monotonic() + seconds
            self.cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- worker thread
    def _resolve(self, job: Job, result=None, error: BaseException | None = None) -> None:
        if job.cancelled or job.future.done():  # its submitter has given up: nobody waits for it
            return
        job.future.set_exception(error) if error is not None else job.future.set_result(result)

    def _gauge_queue(self) -> None:
        self.m.queue_depth.labels("encode").set(len(self.encodes))
        self.m.queue_depth.labels("decode").set(len(self.decodes))

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as e:  # noqa: BLE001 - any load failure is fatal and must be reported
            from ocr_latent.checkpoint import CheckpointError
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
            self._fail_everything(Unavailable("the server is shutting down", self.s.loading_retry_after_s))

    def _load(self) -> None:
        import torch
        if self.s.torch_threads:
            torch.set_num_threads(self.s.torch_threads)
        if self.s.load_delay_s:
            time.sleep(self.s.load_delay_s)
        t0 = time.monotonic()
        from ocr_latent.serving.pipeline import load_pipeline
        if self.s.device.startswith("cuda") and not torch.cuda.is_available():
            raise StartupError(f"DEVICE={self.s.device} but torch {torch.__version__} sees no CUDA device: install "
                               "a CUDA build of torch==2.13.0 in .venv or use DEVICE=cpu")
        self.pipeline = load_pipeline(self.s.model_dir, self.s.quantizer, self.s.device, self.s.dtype, self.s.prefill_dtype,
                                          verify=self.s.verify_pin)
        if "free" not in self.pipeline.prompts:
            raise StartupError("the model's tokenizer cannot spell the 'free' prompt")
        self.gen = self.pipeline.new_generator(self.s.decode_slots, self.s.kv_cache_tokens, self.s.compile)
        if any(self.max_new_tokens(p) < 1 for p in self.pipeline.prompts):
            raise StartupError(f"KV_CACHE_TOKENS={self.s.kv_cache_tokens} leaves {self.gen.slot_tokens} positions per "
                               f"sequence ({self.s.decode_slots} DECODE_SLOTS), less than a page's prompt "
                               f"({self.pipeline.prompt_length('free')}): raise it or lower DECODE_SLOTS")
        t1 = time.monotonic()
        # warm-up: one encode and one short decode through the same code path as requests
        codes = self.pipeline.encode([Image.new("RGB", (64, 64), (255, 255, 255))])
        if codes.shape != (1, NUM_CODES) or int(codes.max()) > MAX_LEVEL:
            raise StartupError(f"warm-up encode gave codes of shape {codes.shape} (max {int(codes.max())}); this "
                               f"service needs {NUM_CODES} codes in 0..{MAX_LEVEL}: check the model's view mode "
                               "and QUANTIZER")
        if self.s.compile:  # every compiling now, none in requests
            self.gen.prepare(self.gen.warmup_shapes())
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

    def _take(self, queue: deque, limit: int) -> list:
        out = []
        while queue and len(out) < limit:
            job = queue.popleft()
            if job.cancelled:
                self.m.dropped.labels("cancelled").inc()
                continue
            if time.monotonic() > job.deadline:
                self.m.dropped.labels("timeout").inc()
                self._resolve(job, error=self.deadline_error())
                continue
            out.append(job)
        return out

    @staticmethod
    def _holding(running: list[DecodeJob]) -> Counter:
        """Group -> its sequences running."""
        return Counter(j.group_key for j in running if j.seq.finish_reason is None)

    def _fair_turn(self, waiting: list[DecodeJob], free: int, holding: Counter) -> list[tuple[DecodeJob, int]]:
        """Which of `waiting` (in arrival order) take the `free` decode slots this turn, in the order chosen,
        each with the sequences its group held before it (`holding`: group -> sequences running).

        Fair turns: each slot goes to the group holding the fewest sequences, counting those chosen this turn,
        ties to the group whose next job arrived first; a group's own jobs go in arrival order. Jobs that
        are groups of their own (group None) thus go first come first served, as ever, and two large files
        share the slots evenly however their pages arrived. And a reserve: a group that holds a sequence, or
        has more than one page waiting, never takes one of the last `reserve` free slots (decode_slots // 8, at
        least 1), so that a lone page finds a slot free within a step or so while large files decode, however
        many files arrived before it. The
        price: a lone large file decodes in decode_slots - reserve slots (14 of 16), the reserve idle."""
        queues: dict[int, deque] = {}  # group -> its waiting jobs, each with its place in the arrival order
        for place, j in enumerate(waiting):
            queues.setdefault(j.group_key, deque()).append((place, j))
        count, out = Counter(holding), []
        while len(out) < free and queues:
            in_reserve = free - len(out) <= self.reserve
            # the reserve is for lone pages: not for a group that holds a sequence or has more pages to come
            allowed = [g for g in queues if not (in_reserve and (count[g] or len(queues[g]) > 1))]
            if not allowed:
                break
            group = min(allowed, key=lambda g: (count[g], queues[g][0][0]))
            _, j = queues[group].popleft()
            if not queues[group]:
                del queues[group]
            out.append((j, count[group]))
            count[group] += 1
        return out

    def _take_decodes(self) -> list[DecodeJob]:
        """Take the decodes that get the free slots this turn (`_fair_turn`) from the queue; the others stay,
        in arrival order. As `_take`, drops the cancelled ones and fails the late ones (from the whole queue)."""
        free = self.gen.capacity
        if not free or not self.decodes:
            return []
        live = self._take(self.decodes, len(self.decodes))  # empties the queue
        taken = [j for j, _ in self._fair_turn(live, free, self._holding(self.running))]
        chosen = set(map(id, taken))
        self.decodes.extend(j for j in live if id(j) not in chosen)
        return taken

    def _serve(self) -> None:
        window = self.s.encode_batch_window_ms / 1000
        while True:
            if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
                self._fail_everything(Unavailable("the server is shutting down", self.s.loading_retry_after_s))
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
                admit = self.admitting = self._take_decodes()
                self._gauge_queue()
            if encode_batch:
                self._encode(encode_batch)
            self._reap()
            if admit:
                self._admit(admit)
            self.admitting = []
            if any(j.seq.finish_reason is None for j in self.running):
                self._step()

    def _encode(self, jobs: list[EncodeJob]) -> None:
        now = time.monotonic()
        for j in jobs:
            self.m.queue_wait.labels("encode").observe(now - j.arrived)
        t0 = time.perf_counter()
        try:
            codes, lost = self.pipeline.encode_measured([j.image for j in jobs])
        except Exception:  # noqa: BLE001
            log.error("encode batch of %d failed; retrying one by one:\n%s", len(jobs), traceback.format_exc())
            for j in jobs:
                try:
                    self._resolve(j, self.pipeline.encode([j.image])[0].copy())
                except Exception as e:  # noqa: BLE001
                    log.error("encode failed:\n%s", traceback.format_exc())
                    self._resolve(j, error=ModelFailure(f"encoding failed: {type(e).__name__}: {e}"))
            return
        self.m.encode_seconds.observe(time.perf_counter() - t0)
        self.m.encode_batch.observe(len(jobs))
        self.m.images.inc(len(jobs))
        for j, c, l in zip(jobs, codes, lost):
            j.fidelity = self.pipeline.fidelity(float(l))
            if j.fidelity is not None:
                self.m.fidelity.observe(j.fidelity)
            self._resolve(j, c.copy())

    def _admit(self, jobs: list[DecodeJob]) -> None:
        now = time.monotonic()
        inputs, ok = [], []
        for j in jobs:
            self.m.queue_wait.labels("decode").observe(now - j.arrived)
            try:
                inputs.append(self.pipeline.decode_inputs(j.codes, j.prompt))
                j.prompt_tokens = inputs[-1].shape[0]
                ok.append(j)
            except Exception as e:  # noqa: BLE001
                log.error("decode_inputs failed:\n%s", traceback.format_exc())
                self._resolve(j, error=ModelFailure(f"decoding failed: {type(e).__name__}: {e}"))
        if not ok:
            return
        t0 = time.perf_counter()
        try:
            seqs = self.gen.add(inputs, [j.max_tokens for j in ok], [j.min_tokens for j in ok],
                                [j.ignore_eos for j in ok])
        except Exception as e:  # noqa: BLE001
            self._generator_failed(e, ok)
            return
        self.m.prefill_seconds.observe(time.perf_counter() - t0)
        self.m.prefill_batch.observe(len(ok))
        self.m.count_tokens(len(ok))
        for j, seq in zip(ok, seqs):
            j.seq = seq
            if j.on_text is not None:
                j.stream = TextStream(self.pipeline.raw_text)
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
        seconds = time.perf_counter() - t0
        self.m.step_seconds.observe(seconds)
        self._track_step(seconds)
        self.m.decode_batch.observe(n)
        self.m.count_tokens(n)
        self._finish_done()

    def _track_step(self, seconds: float) -> None:
        """Update `step_s`, the step time behind submit's early refusals: an exponential moving average that
        leans low, halfway to a faster step, 5% of the way to a slower one (counted as at most twice the
        estimate). Too high, it refuses work that would have run (say, after a slow outlier: a CUDA graph
        captured for a new shape); too low, it only queues work that then times out, as with no estimate."""
        est = self.step_s
        self.step_s = seconds if est is None else \
            est + (0.5 if seconds < est else 0.05) * (min(seconds, 2 * est) - est)

    def _send_text(self, job: DecodeJob, piece: str) -> None:
        if piece and not job.cancelled:
            try:
                job.on_text(piece)
            except Exception:  # noqa: BLE001 - the listener is gone (e.g. its event loop closed)
                log.warning("text listener failed; cancelling its job:\n%s", traceback.format_exc())
                job.cancelled = True

    def _finish_done(self) -> None:
        still = []
        for j in self.running:
            seq = j.seq
            if seq.finish_reason is None and self._unsure(j):
                seq.finish_reason = "low_confidence"
            if seq.finish_reason is None:
                still.append(j)
                if j.stream is not None:
                    self._send_text(j, j.stream.feed(seq.tokens))
                continue
            confidence = self.pipeline.confidence(self.gen.token_logprobs(seq), seq.finish_reason, j.codes)
            self.gen.drop(seq)
            try:
                text = self.pipeline.text(seq.tokens)
            except Exception as e:  # noqa: BLE001
                self._resolve(j, error=ModelFailure(f"detokenising failed: {type(e).__name__}: {e}"))
                continue
            n = len(seq.tokens) - (1 if seq.finish_reason == "stop" else 0)
            self.m.finish.labels(seq.finish_reason).inc()
            if confidence is not None:
                self.m.confidence.observe(confidence)
            if j.stream is not None:
                self._send_text(j, j.stream.finish(text))
            self._resolve(j, DecodeResult(text, n, seq.finish_reason, j.prompt_tokens, confidence))
        self.running = still
        self.m.active.set(len(self.running))

    def _unsure(self, j: DecodeJob) -> bool:
        """The early stop (Engine.decode's min_confidence): checked every EARLY_STOP_EVERY tokens from
        EARLY_STOP_TOKENS on, as if the reading ended there (one read of its log-probabilities)."""
        n = len(j.seq.tokens)
        if j.min_confidence is None or n < EARLY_STOP_TOKENS or n % EARLY_STOP_EVERY:
            return False
        return self.pipeline.confidence(self.gen.token_logprobs(j.seq), "stop", j.codes) < j.min_confidence

    def _reap(self) -> None:
        """Drop sequences whose submitter cancelled them or whose deadline passed."""
        if not self.running:
            return
        now, still = time.monotonic(), []
        for j in self.running:
            if j.cancelled or now > j.deadline:
                self.gen.drop(j.seq)
                self.m.dropped.labels("cancelled" if j.cancelled else "timeout").inc()
                if not j.cancelled:
                    self._resolve(j, error=self.deadline_error())
            else:
                still.append(j)
        self.running = still
        self.m.active.set(len(self.running))

    def _generator_failed(self, e: Exception, extra: list[DecodeJob]) -> None:
        """The generator's state is unknown after an exception: fail its sequences, start a fresh one."""
        log.error("decode batch failed; restarting the generator:\n%s", traceback.format_exc())
        err = ModelFailure(f"decoding failed: {type(e).__name__}: {e}")
        for j in self.running + extra:
            self._resolve(j, error=err)
        self.running = []
        self.m.active.set(0)
        self.gen = self.pipeline.new_generator(self.s.decode_slots, self.s.kv_cache_tokens, self.s.compile)

    def _fail_everything(self, err: EngineError) -> None:
        with self.cv:
            pending = list(self.encodes) + list(self.decodes) + self.running
            for j in self.running:
                self.gen.drop(j.seq)
            self.encodes.clear(), self.decodes.clear()
            self.running = []
            self.m.active.set(0)
            self._gauge_queue()
        for j in pending:
            self._resolve(j, error=err)
