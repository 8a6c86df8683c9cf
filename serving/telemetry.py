"""Prometheus metrics of the service: what the engine does (queues, batches, steps, tokens) and what
the HTTP face answers (requests by endpoint and status). One registry per service instance."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest


class Metrics:
    def __init__(self):
        disable_created_metrics()  # no *_created series: they only add noise to scrapes
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ocr_latent_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("ocr_latent_request_seconds", "HTTP request latency by endpoint", ["endpoint"],
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 25, 60, 120, 300),
                                 registry=r)
        self.queue_depth = Gauge("ocr_latent_queue_depth", "requests waiting for the worker", ["kind"], registry=r)
        self.queue_wait = Histogram("ocr_latent_queue_wait_seconds", "time from arrival to entering a batch",
                                    ["kind"], buckets=(.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 120), registry=r)
        self.encode_batch = Histogram("ocr_latent_encode_batch_size", "images per encode batch",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.encode_seconds = Histogram("ocr_latent_encode_batch_seconds", "seconds per encode batch",
                                        buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.decode_batch = Histogram("ocr_latent_decode_batch_size", "running sequences per decode step",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128), registry=r)
        self.prefill_batch = Histogram("ocr_latent_prefill_batch_size", "sequences per prefill",
                                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("ocr_latent_decode_step_seconds", "seconds per decode step",
                                      buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.prefill_seconds = Histogram("ocr_latent_prefill_seconds", "seconds per prefill (prompts into the cache)",
                                         buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10), registry=r)
        self.active = Gauge("ocr_latent_active_sequences", "sequences in the running decode batch", registry=r)
        self.images = Counter("ocr_latent_encoded_images_total", "images encoded", registry=r)
        self.tokens = Counter("ocr_latent_decode_tokens_total", "tokens generated (EOS included)", registry=r)
        self.tokens_per_s = Gauge("ocr_latent_decode_tokens_per_second",
                                  "decode throughput over the last few seconds", registry=r)
        self.finish = Counter("ocr_latent_decode_finished_total", "finished decodes by reason", ["reason"],
                              registry=r)
        self.dropped = Counter("ocr_latent_dropped_total", "requests dropped by the worker", ["reason"], registry=r)
        self.connections_closed = Counter(
            "ocr_latent_connections_closed_total", "connections the server refused or cut before a request was "
            "answered: max_connections, per_client (MAX_CONNECTIONS_PER_CLIENT), head_timeout, body_timeout",
            ["reason"], registry=r)
        self.confidence = Histogram("ocr_latent_decode_confidence", "confidence of each reading (0..1)",
                                    buckets=(.05, .1, .2, .3, .4, .5, .6, .7, .8, .9, .95, 1), registry=r)
        self.fidelity = Histogram("ocr_latent_encode_fidelity", "fidelity of each page's codes (0..1)",
                                  buckets=(.05, .1, .2, .3, .4, .5, .6, .7, .8, .9, .95, 1), registry=r)
        self.ready = Gauge("ocr_latent_ready", "1 once the model is loaded and warmed up", registry=r)
        self._window: deque[tuple[float, int]] = deque()

    def count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.tokens.inc(n)
        self._window.append((now, n))
        self._update_rate(now)

    def _update_rate(self, now: float, horizon: float = 5.0) -> None:
        while self._window and self._window[0][0] < now - horizon:
            self._window.popleft()
        if not self._window:
            self.tokens_per_s.set(0)
            return
        span = max(now - self._window[0][0], 1.0)
        self.tokens_per_s.set(sum(n for _, n in self._window) / span)

    def render(self) -> bytes:
        self._update_rate(time.monotonic())
        return generate_latest(self.registry)


