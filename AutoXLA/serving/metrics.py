"""The server's Prometheus metrics (``/metrics``), with prometheus_client, in a registry of the
server's own (two servers in one process, as in the tests, do not share counts)."""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from .. import backend

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth, live_slots, window_seconds: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("autoxla_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("autoxla_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("autoxla_generated_tokens", "tokens generated",
                                        registry=r)
        self.finished_sequences = Counter("autoxla_sequences_finished", "sequences ended",
                                          ["reason"], registry=r)
        self.ttft = Histogram("autoxla_time_to_first_token_seconds", "queue wait and prefill",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("autoxla_inter_token_latency_seconds", "between two tokens of one "
                             "sequence", buckets=_LATENCY_BUCKETS, registry=r)
        Gauge("autoxla_queue_depth", "sequences waiting for a slot",
              registry=r).set_function(queue_depth)
        Gauge("autoxla_slots_in_use", "slots holding a live sequence",
              registry=r).set_function(live_slots)
        Gauge("autoxla_programs_compiled", "XLA programs compiled by this process",
              registry=r).set_function(backend.compile_count)
        Gauge("autoxla_tokens_per_second", f"tokens generated per second over the last "
              f"{window_seconds:g} s", registry=r).set_function(self._rate)
        self._window = window_seconds
        self._recent: collections.deque[float] = collections.deque()
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()

    # -- called by the scheduler's thread ---------------------------------------------------
    def admitted(self, seq) -> None:
        self.prompt_tokens.inc(len(seq.prompt))

    def token(self, seq, now: float) -> None:
        self.generated_tokens.inc()
        previous = self._last.get(id(seq))
        if previous is None:
            self.ttft.observe(now - seq.submitted)
        else:
            self.itl.observe(now - previous)
        self._last[id(seq)] = now
        with self._lock:
            self._recent.append(now)

    def finished(self, seq) -> None:
        self._last.pop(id(seq), None)
        self.finished_sequences.labels(seq.finish_reason).inc()

    # -- called by the server ------------------------------------------------------------------
    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _rate(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0] < now - self._window:
                self._recent.popleft()
            return len(self._recent) / self._window
