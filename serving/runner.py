"""The uvicorn runner of server.py's app (`ocr-latent serve`, `python server.py`): logging, an h11
protocol with a deadline on request heads, the open-file limit, draining on SIGTERM, and exit status 1
when the model cannot be loaded."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Callable

from ocr_latent.serving.guard import JsonFormatter, RequestIdFilter
from ocr_latent.serving.settings import settings as read_settings

log = logging.getLogger("ocr_latent.server")


def over_capacity_in_json(retry_after_s: int) -> None:
    """Beyond MAX_CONNECTIONS uvicorn answers every request itself, before the app, with a plain-text 503;
    its h11 protocol looks that answer up by name when it needs it, so the name is pointed at one in the
    service's JSON error format, with Retry-After, like every other error."""
    import json

    from uvicorn.protocols.http import h11_impl
    body = json.dumps({"error": {"type": "overloaded", "message": "too many open connections (MAX_CONNECTIONS): "
                                 "retry shortly"}}).encode()

    async def service_unavailable(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after_s).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    h11_impl.service_unavailable = service_unavailable


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline on the request head: a connection that says nothing, or
    trickles its headers, is closed after `seconds` instead of holding an open file for ever (uvicorn
    only times out connections that are idle after a response)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole head arrived: the request's own deadline governs from here

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next head on this keep-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11


def raise_open_file_limit() -> None:
    """Soft limit up to the hard one: every client connection holds a file descriptor."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def run(create_app: Callable[..., object]) -> int:
    """uvicorn on HOST:PORT serving `create_app(settings, on_fatal=...)` (server.create_app); exits non-zero
    when the model cannot be loaded. On SIGTERM/SIGINT the engine drains for SHUTDOWN_DRAIN_S, then answers
    what is left with a JSON 503, before uvicorn's own graceful timeout (2 s later) would cut those requests off."""
    import uvicorn
    settings = read_settings()
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    host, port = settings.host, settings.port
    failure: list[str] = []
    server = None

    def fatal(message: str) -> None:  # the engine has logged the message
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=fatal)
    drain = settings.shutdown_drain_s

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine = getattr(app.state, "engine", None)
            if engine is not None:
                engine.drain(drain)
            super().handle_exit(sig, frame)

    raise_open_file_limit()
    over_capacity_in_json(settings.retry_after_s)
    if not app.state.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model "
                    "(set API_KEY or API_KEY_FILE)", host)
    # log_config=None: uvicorn's own lines go through the handler above (request ids, JSON)
    config = uvicorn.Config(app, host=host, port=port, log_level=settings.log_level.lower(), log_config=None,
                            timeout_graceful_shutdown=int(drain) + 2, access_log=settings.access_log,
                            http=header_timeout_protocol(settings.header_timeout_s),
                            limit_concurrency=settings.max_connections)
    server = Server(config)
    # uvicorn raises the signal that stopped it again once it has shut down; with this handler in place
    # a SIGTERM ends in a clean exit (status 0) instead of death by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    if failure:  # repeated last, after uvicorn's shutdown lines, so it is what the user sees
        sys.stderr.write(f"ocr-latent: not serving: startup failed: {failure[0]}\n")
        return 1
    return 0
