"""The same HTTP API on Ray Serve (`BACKEND=ray ./serve.sh`, or `serve deploy deploy/serve-config.yaml`).

Three deployments in one Serve application:
  * `encode` and `decode`: each replica runs the project's own `engine.Engine` (its thread, its
    micro-batching and continuous batching); Serve only spreads requests over replicas;
  * `http`: server.py's FastAPI app, unchanged, as the Serve ingress; its engine is a `RemoteEngine`
    whose jobs are requests to the two deployments above, so paths, schemas and errors are server.py's.

Engine errors travel back as values (`Refused`) and become the same HTTP statuses as on one machine.
A request whose replica dies before answering is sent again (decoding and encoding are pure: the same
input gives the same output) while its deadline allows; a streamed decode that loses its replica
mid-stream ends with an `unavailable` error event (retryable).

Configuration is server.py's (environment variables), plus ENCODE_REPLICAS / DECODE_REPLICAS (a
number, or `auto` for Serve's autoscaling), REPLICA_CPUS, ENCODE_GPUS / DECODE_GPUS (fractions of a GPU
per replica when DEVICE is not cpu), and for a local Ray RAY_NUM_CPUS / RAY_OBJECT_STORE_BYTES. With
RAY_ADDRESS set the service joins that cluster; otherwise it starts a local Ray. See docs/deployment.md.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from ocr_latent.serving.engine import DecodeResult, Engine, EngineConfig
from ocr_latent.serving.errors import (Cancelled, DeadlineExceeded, EngineError, Loading, ModelFailure, Overloaded,
                                       Unavailable)
from ocr_latent.serving.interface import EngineState, ServiceInfo, check_lengths
from ocr_latent.serving.settings import environment, settings
from ocr_latent.serving.streaming import TextFeed
from ocr_latent.serving.telemetry import Metrics

log = logging.getLogger("ocr_latent.ray")
APP_NAME = "ocr-latent"
RESEND_ATTEMPTS = 4  # sends of one request whose replica died before answering
# what the replicas read from the environment; forwarded to them (a joined cluster's workers do not
# inherit this process's environment)
FORWARDED_ENV = ("MODEL_DIR", "QUANTIZER", "VERIFY_PIN", "DEVICE", "DTYPE", "PREFILL_DTYPE", "TORCH_THREADS",
                 "ENCODE_BATCH_WINDOW_MS", "ENCODE_MAX_BATCH", "DECODE_SLOTS", "MAX_QUEUE", "KV_CACHE_TOKENS", "REQUEST_TIMEOUT_S",
                 "RETRY_AFTER_S", "SHUTDOWN_DRAIN_S", "MAX_BODY_BYTES", "MAX_IMAGE_PIXELS", "MAX_PAGES", "API_KEY",
                 "API_KEY_FILE", "HEADER_TIMEOUT_S", "MAX_CONNECTIONS", "LOG_LEVEL",
                 "OCR_LATENT_TEST_LOAD_DELAY_S", "OCR_LATENT_TEST_STEP_DELAY_S")


@dataclass
class Encoded:
    """A page's codes and their fidelity (engine.EncodeJob's), as an encode replica answers them."""
    codes: np.ndarray
    fidelity: float | None = None


@dataclass
class Refused:
    """An EngineError as a value: exceptions cross Ray wrapped, and these must keep their class and Retry-After."""
    kind: str
    message: str
    retry_after_s: float | None = None

    KINDS = {c.__name__: c for c in (Overloaded, Unavailable, Loading, DeadlineExceeded, Cancelled, ModelFailure)}

    @classmethod
    def of(cls, e: EngineError) -> "Refused":
        return cls(type(e).__name__, e.message, e.retry_after_s)

    def error(self) -> EngineError:
        return self.KINDS.get(self.kind, ModelFailure)(self.message, self.retry_after_s)


# ----------------------------------------------------------------------------- the replicas
class EngineReplica:
    """One replica of the `encode` or `decode` deployment: an Engine in this process, loaded and warmed
    up before Serve sends it anything (a model that cannot load fails the deployment)."""

    def __init__(self):
        self.engine = Engine(EngineConfig.from_env()).start()
        self.engine.wait_ready()

    def info(self) -> dict:
        p = self.engine.pipeline
        return {"quantizer_fingerprint": p.quantizer_fingerprint, "mode": p.mode, "prompts": list(p.prompts),
                "label": p.label, "revision": p.revision, "device": p.device,
                "max_new_tokens": {name: self.engine.max_new_tokens(name) for name in p.prompts}}

    def check_health(self) -> None:  # Serve replaces a replica whose engine died
        if self.engine.failed or not self.engine.thread.is_alive():
            raise RuntimeError(f"engine stopped: {self.engine.failed or 'worker thread gone'}")

    async def _result(self, submit):
        try:
            job = submit()
        except EngineError as e:
            return Refused.of(e)
        try:
            return await asyncio.wrap_future(job.future)
        except EngineError as e:
            return Refused.of(e)
        finally:
            if not job.future.done():  # the caller cancelled (its client left, or its deadline passed)
                self.engine.cancel(job)

    async def encode(self, image) -> Encoded | Refused:
        jobs = []
        result = await self._result(lambda: jobs.append(self.engine.encode(image)) or jobs[0])
        return result if isinstance(result, Refused) else Encoded(result, jobs[0].fidelity)

    async def decode(self, codes: np.ndarray, prompt: str, max_tokens: int, min_tokens: int = 0,
                     ignore_eos: bool = False, min_confidence: float | None = None) -> DecodeResult | Refused:
        return await self._result(lambda: self.engine.decode(codes, prompt, max_tokens, min_tokens=min_tokens,
                                                             ignore_eos=ignore_eos, min_confidence=min_confidence))

    async def decode_stream(self, codes: np.ndarray, prompt: str, max_tokens: int, min_tokens: int = 0,
                            ignore_eos: bool = False, min_confidence: float | None = None):
        """Pieces of text (str) as they are generated, then the DecodeResult (or a Refused)."""
        feed = TextFeed()
        try:
            job = self.engine.decode(codes, prompt, max_tokens, on_text=feed.on_text, min_tokens=min_tokens,
                                     ignore_eos=ignore_eos, min_confidence=min_confidence)
        except EngineError as e:
            yield Refused.of(e)
            return
        result = asyncio.wrap_future(job.future)
        try:
            async for piece in feed.follow(result):
                yield piece
            try:
                yield result.result()
            except EngineError as e:
                yield Refused.of(e)
        finally:
            if not job.future.done():
                self.engine.cancel(job)


# ----------------------------------------------------------------------------- the ingress's engine
@dataclass(eq=False, kw_only=True)
class RemoteJob:
    """What server.py waits on: `future` and `deadline`, as engine.Job has them."""
    deadline: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False
    task: asyncio.Task | None = None
    response: object = None  # the Serve response in flight
    fidelity: float | None = None  # an encode's, once done


class RemoteEngine(EngineState):
    """The surface of engine.Engine that server.py's endpoints use, with the work done by the `encode`
    and `decode` deployments of this Serve application. Ready once both answer and agree on the quantizer."""

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None, on_fatal=None, app_name: str = APP_NAME):
        self.s, self.m = config, metrics or Metrics()
        self.handles = {kind: serve.get_deployment_handle(kind, app_name) for kind in ("encode", "decode")}
        self.info: ServiceInfo | None = None
        self.ready, self.failed = False, None
        self.most_tokens: dict[str, int] = {}
        self.loader: asyncio.Task | None = None

    def start(self) -> "RemoteEngine":  # called in the app's lifespan, on its event loop
        self.loader = asyncio.get_running_loop().create_task(self._load())
        return self

    async def _load(self) -> None:
        try:
            encode, decode = [await h.info.remote() for h in (self.handles["encode"], self.handles["decode"])]
        except Exception as e:  # noqa: BLE001 - reported by /health, as a failed load is on one machine
            self.failed = f"the replicas did not answer: {type(e).__name__}: {e}"
            log.error("%s", self.failed)
            return
        if encode["quantizer_fingerprint"] != decode["quantizer_fingerprint"]:
            self.failed = (f"the encode replicas use quantizer {encode['quantizer_fingerprint']}, the decode replicas "
                           f"{decode['quantizer_fingerprint']}: give both the same MODEL_DIR and QUANTIZER")
            log.error("%s", self.failed)
            return
        self.most_tokens = decode.pop("max_new_tokens")
        self.info = ServiceInfo(decode["label"], decode["revision"], decode["device"], decode["quantizer_fingerprint"],
                                decode["mode"], tuple(decode["prompts"]))
        self.ready = True
        self.m.ready.set(1)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loader is not None:
            self.loader.get_loop().call_soon_threadsafe(self.loader.cancel)

    def max_new_tokens(self, prompt: str = "free") -> int:
        """As Engine.max_new_tokens: what a decode replica's cache slot holds beyond the prompt."""
        return self.most_tokens[prompt]

    def encode(self, image, timeout_s: float | None = None) -> RemoteJob:
        self.check_ready()
        job = RemoteJob(deadline=self.deadline(timeout_s))
        job.task = asyncio.get_running_loop().create_task(self._call(job, "encode", image))
        return job

    def decode(self, codes: np.ndarray, prompt: str = "free", max_tokens: int = 4096,
               timeout_s: float | None = None, on_text=None, min_tokens: int = 0, ignore_eos: bool = False,
               group: object = None, min_confidence: float | None = None) -> RemoteJob:
        # `group` (Engine.decode's fair turns) stays here: the replicas take each page as a request of its own
        # (a group is compared by identity, which would not survive the trip to them)
        self.check_ready()
        if prompt not in self.prompts:
            raise ValueError(f"prompt {prompt!r} is not available for model {self.info.label!r} "
                             f"(available: {', '.join(self.prompts)})")
        # what the replica would refuse: a 422 here, not a 500 there
        check_lengths(max_tokens, min_tokens, self.max_new_tokens(prompt),
                      "a decode replica's cache slot (KV_CACHE_TOKENS, DECODE_SLOTS) holds the page, the prompt and the tokens")
        job = RemoteJob(deadline=self.deadline(timeout_s))
        args = (codes, prompt, max_tokens, min_tokens, ignore_eos, min_confidence)
        job.task = asyncio.get_running_loop().create_task(
            self._call(job, "decode", *args) if on_text is None else self._stream(job, on_text, *args))
        return job

    def cancel(self, job: RemoteJob) -> None:
        if not job.future.done():
            job.cancelled = True
            job.task.get_loop().call_soon_threadsafe(job.task.cancel)

    def drain(self, seconds: float) -> None:  # Serve drains its replicas itself (graceful_shutdown_timeout_s)
        pass

    def _resolve(self, job: RemoteJob, result=None, error: BaseException | None = None) -> None:
        if job.cancelled or job.future.done():
            return
        if isinstance(result, Refused):
            result, error = None, result.error()
        job.future.set_exception(error) if error is not None else job.future.set_result(result)

    def _replica_lost(self, kind: str, e: BaseException) -> Unavailable:
        return Unavailable(f"the {kind} replica serving this request stopped ({type(e).__name__}); retry",
                           self.s.retry_after_s)

    async def _call(self, job: RemoteJob, kind: str, *args) -> None:
        for attempt in range(RESEND_ATTEMPTS):
            job.response = getattr(self.handles[kind], kind).remote(*args)
            try:
                result = await job.response
            except asyncio.CancelledError:
                job.response.cancel()
                raise
            except BackPressureError:  # every replica's queue and Serve's own are full
                return self._resolve(job, error=Overloaded(f"all {kind} replicas are busy (MAX_QUEUE); retry later",
                                                           self.s.retry_after_s))
            except (RayActorError, ActorUnavailableError) as e:
                # the replica died (killed, out of memory, its node lost) before answering: send it again,
                # to another replica or its replacement, while the deadline allows
                log.warning("%s replica lost (%s); attempt %d of %d", kind, type(e).__name__, attempt + 1, RESEND_ATTEMPTS)
                if attempt + 1 == RESEND_ATTEMPTS or time.monotonic() > job.deadline:
                    return self._resolve(job, error=self._replica_lost(kind, e))
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            except Exception as e:  # noqa: BLE001 - a bug on the replica: a 500, as on one machine
                return self._resolve(job, error=ModelFailure(f"{kind} failed: {type(e).__name__}: {e}"))
            if isinstance(result, Encoded):
                job.fidelity, result = result.fidelity, result.codes
            return self._resolve(job, result)

    async def _stream(self, job: RemoteJob, on_text, *args) -> None:
        job.response = self.handles["decode"].options(stream=True).decode_stream.remote(*args)
        try:
            async for item in job.response:
                if isinstance(item, str):
                    on_text(item)
                else:
                    self._resolve(job, item)
        except asyncio.CancelledError:
            job.response.cancel()
            raise
        except BackPressureError:
            self._resolve(job, error=Overloaded("all decode replicas are busy (MAX_QUEUE); retry later",
                                                self.s.retry_after_s))
        except (RayActorError, ActorUnavailableError) as e:  # pieces were sent already: it cannot be resent
            self._resolve(job, error=self._replica_lost("decode", e))
        except Exception as e:  # noqa: BLE001
            self._resolve(job, error=ModelFailure(f"decode failed: {type(e).__name__}: {e}"))


# ----------------------------------------------------------------------------- the application
def http_app():
    """Built on the ingress replica: server.py's app, its engine a RemoteEngine on this application."""
    from ocr_latent import server
    try:
        app_name = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - outside a replica
        app_name = APP_NAME
    app = server.create_app(settings(),
                            lambda config, metrics, on_fatal: RemoteEngine(config, metrics, on_fatal, app_name))
    app.add_middleware(OneRequestId)
    return app


class OneRequestId:
    """Serve's proxy gives every request an X-Request-ID (the client's, else a new one) before server.py's
    Guard sees it, and adds it to the response itself: Guard's copy would make the header appear twice."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def send_once(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]}
            await send(message)
        return await self.app(scope, receive, send_once)


@serve.ingress(http_app)
class HttpIngress:
    """The HTTP face: all of it is server.py's app (`http_app`), which finds the engine deployments by name;
    they are bound here so that they belong to the application."""

    def __init__(self, encode, decode):
        pass


def replicas_option(value: str | int) -> dict:
    if str(value).strip().lower() == "auto":
        return {"num_replicas": "auto"}  # Serve's default autoscaling (1 to 100 replicas, by ongoing requests)
    try:
        n = int(value)
    except ValueError:
        raise SystemExit(f"replicas={value!r}: give a number >= 1 or 'auto'") from None
    if n < 1:
        raise SystemExit(f"replicas={value!r}: give a number >= 1 or 'auto'")
    return {"num_replicas": n}


def build_app(encode_replicas: str | int = 1, decode_replicas: str | int = 1, env: dict | None = None):
    """The Serve application. `env`: variables for the replicas' runtime_env (None: the cluster's own,
    or the config file's runtime_env)."""
    config = EngineConfig.from_env()
    s = settings()
    cpus = s.replica_cpus if s.replica_cpus is not None else float(config.torch_threads or 1)
    on_gpu = config.device != "cpu"
    runtime = {"runtime_env": {"env_vars": env}} if env else {}
    drain = config.shutdown_drain_s + 2

    def engine_deployment(kind: str, replicas, gpus: float, in_flight: int):
        # in_flight: what one engine takes before its own queue refuses (Overloaded, a 503); Serve queues
        # at most MAX_QUEUE more in front of the replicas, then refuses too (BackPressureError, a 503)
        return serve.deployment(EngineReplica, name=kind, max_ongoing_requests=in_flight,
                                max_queued_requests=config.max_queue, graceful_shutdown_timeout_s=drain,
                                health_check_period_s=5, **replicas_option(replicas),
                                ray_actor_options={"num_cpus": cpus, "num_gpus": gpus if on_gpu else 0, **runtime}).bind()

    encode = engine_deployment("encode", encode_replicas, s.encode_gpus,
                               config.encode_max_batch + config.max_queue + 1)
    decode = engine_deployment("decode", decode_replicas, s.decode_gpus,
                               config.decode_slots + config.max_queue + 1)
    ingress = serve.deployment(HttpIngress, name="http", max_ongoing_requests=s.max_connections,
                               graceful_shutdown_timeout_s=drain,
                               ray_actor_options={"num_cpus": s.ingress_cpus, **runtime})
    return ingress.bind(encode, decode)


def build(args: dict):
    """`import_path: ray_serve:build` for `serve run` / `serve deploy` (deploy/serve-config.yaml):
    args `encode_replicas`, `decode_replicas` (default: ENCODE_REPLICAS / DECODE_REPLICAS, else 1)."""
    return build_app(args.get("encode_replicas", settings().encode_replicas),
                     args.get("decode_replicas", settings().decode_replicas))


def main() -> int:
    """`BACKEND=ray ./serve.sh`: a local Ray (or the cluster at RAY_ADDRESS), Serve's HTTP proxy on
    HOST:PORT, this application deployed; runs until SIGTERM/SIGINT, then removes it."""
    import ray
    s = settings()  # a bad variable stops here, with its message, before Ray starts
    s.bearer_key()
    logging.basicConfig(level=s.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = s.host, s.port
    joined = s.ray_address is not None
    if joined:
        ray.init(address=s.ray_address)
    else:
        ray.init(num_cpus=s.ray_num_cpus, include_dashboard=False,
                 object_store_memory=s.ray_object_store_bytes)
    env = environment(FORWARDED_ENV)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(s.encode_replicas, s.decode_replicas, env),
                  name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d (Ray %s)", host, port, "cluster " + s.ray_address if joined else "local")
        stop.wait()
        return 0
    except Exception as e:  # noqa: BLE001 - a deployment that cannot start (its replicas logged why)
        sys.stderr.write(f"ocr-latent: not serving: startup failed on Ray: {type(e).__name__}: {e}\n")
        return 1
    finally:
        # a joined cluster keeps running (and serving its other applications); a local one goes with us
        try:
            serve.delete(APP_NAME) if joined else serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
