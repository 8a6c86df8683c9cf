"""The uvicorn runner of server.py's app (`ocr-latent serve`, `python server.py`): logging, an h11
protocol with deadlines on request heads and bodies and a cap on connections per client, the open-file limit, draining on SIGTERM, and exit status 1
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


def refusing(app, reason: str, message: str, retry_after_s: int, metrics):
    """An ASGI app that answers every request but /health (which goes on to `app`: a probe must not see a busy
    server as a dead one) with a 503 in the service's JSON error format, Retry-After, the connection closed,
    and counts it in ocr_latent_connections_closed_total under `reason`."""
    import json
    body = json.dumps({"error": {"type": "overloaded", "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(retry_after_s).encode()), (b"connection", b"close")]

    async def refuse(scope, receive, send) -> None:
        if scope.get("path") == "/health":
            return await app(scope, receive, send)
        metrics.connections_closed.labels(reason).inc()
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return refuse


def over_capacity_in_json(app, retry_after_s: int, metrics) -> None:
    """Beyond MAX_CONNECTIONS uvicorn answers every request itself, before the app, with a plain-text 503;
    its h11 protocol looks that answer up by name when it needs it, so the name is pointed at `refusing`'s,
    like every other error in JSON, counted, and /health still answered."""
    from uvicorn.protocols.http import h11_impl
    h11_impl.service_unavailable = refusing(app, "max_connections", "too many open connections (MAX_CONNECTIONS): "
                                            "retry shortly", retry_after_s, metrics)


def request_timeout_response(message: str) -> bytes:
    """A whole HTTP/1.1 408 in the service's JSON error format, for a connection closed right after it."""
    import json
    body = json.dumps({"error": {"type": "request_timeout", "message": message}}).encode()
    return (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def guarded_protocol(s, metrics):
    """uvicorn's h11 protocol with what it lacks against slow or many clients (settings `s`):

    - a deadline on the request head (HEADER_TIMEOUT_S): a connection that says nothing, or trickles its
      headers, is closed instead of holding an open file for ever (uvicorn only times out connections that are
      idle after a response);
    - a deadline on the request body (BODY_TIMEOUT_S from the end of the head): a body that stops, or
      trickles, has its connection answered 408 (if nothing was answered yet) and closed, and its request sees
      the client gone, so what it held (its part of BODY_MEMORY_BYTES) is given back;
    - at most MAX_CONNECTIONS_PER_CLIENT open connections from one client address: a request on one more is
      answered 503 and its connection closed (a silent one goes at HEADER_TIMEOUT_S), so one client cannot
      hold the MAX_CONNECTIONS that all share; /health still answers on it.
    Each of these is counted in ocr_latent_connections_closed_total."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    per_client: dict[str, int] = {}
    busy = (f"too many open connections from this address (MAX_CONNECTIONS_PER_CLIENT={s.max_connections_per_client}); "
            f"reuse one, or retry shortly")

    slow = request_timeout_response(f"the request body did not arrive within {s.body_timeout_s:g} s of its head "
                                    f"(BODY_TIMEOUT_S); send it at once, or in less time")

    class GuardedH11(H11Protocol):
        _timer = None
        _client = None
        _timed = None  # the request whose body the timer is for

        def _arm(self, seconds: float, callback) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, callback)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_timed_out(self) -> None:
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                metrics.connections_closed.labels("head_timeout").inc()
                self.transport.close()

        def _body_timed_out(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete or not cycle.more_body or self.transport.is_closing():
                return
            from ocr_latent.serving.guard import STATUS
            metrics.connections_closed.labels("body_timeout").inc()
            cycle.scope[STATUS] = 408
            if not cycle.response_started:
                self.transport.write(slow)
            cycle.disconnected = True  # what the app sends from now on goes nowhere
            cycle.message_event.set()  # and its request, waiting for the rest of the body, sees the client gone
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._client = peer[0] if isinstance(peer, tuple) and peer else None
            if self._client is not None:
                per_client[self._client] = per_client.get(self._client, 0) + 1
                if per_client[self._client] > s.max_connections_per_client:
                    # its requests are refused as they come (this connection's only)
                    self.app = refusing(self.app, "per_client", busy, s.retry_after_s, metrics)
            self._arm(s.header_timeout_s, self._head_timed_out)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and cycle is not self._timed:
                # a whole head arrived: its body has BODY_TIMEOUT_S from now (a request without a body is done)
                self._timed = cycle
                if cycle.more_body:
                    self._arm(s.body_timeout_s, self._body_timed_out)
                else:
                    self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm(s.header_timeout_s, self._head_timed_out)  # the next head on this keep-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._client is not None:
                left = per_client.get(self._client, 1) - 1
                if left > 0:
                    per_client[self._client] = left
                else:
                    per_client.pop(self._client, None)
                self._client = None
            super().connection_lost(exc)

    return GuardedH11


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
    over_capacity_in_json(app, settings.retry_after_s, app.state.metrics)
    if not app.state.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model "
                    "(set API_KEY or API_KEY_FILE)", host)
    # log_config=None: uvicorn's own lines go through the handler above (request ids, JSON)
    config = uvicorn.Config(app, host=host, port=port, log_level=settings.log_level.lower(), log_config=None,
                            timeout_graceful_shutdown=int(drain) + 2, access_log=settings.access_log,
                            http=guarded_protocol(settings, app.state.metrics),
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
