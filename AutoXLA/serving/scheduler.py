"""The host side of continuous batching: a bounded queue of sequences, a thread that owns the
device, and what each step's tokens mean for each request (text, stop conditions, events).

One thread runs the loop: admit waiting sequences into free slots (each admission is one
prefill), run one decode step for every slot, hand each live sequence its token, free the slots
of those that finished (EOS or a stop token, ``max_tokens``, a stop string) or were cancelled (a
client that went away, a timeout). Requests join and leave only between two steps, and every
step runs the same program, so no traffic compiles anything after warm-up.

Events reach the request's handler through ``Sequence.emit``, a callable the server gives (it
hands them to its event loop thread-safely); the scheduler never blocks on a client.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import backend
from .engine import Picked, Sampling, SlotEngine
from .text import Detokenizer

logger = logging.getLogger("AutoXLA")


class QueueFull(Exception):
    """The waiting queue is at its bound: the server answers 429."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work: the server answers 503."""


@dataclass
class Token:
    """One generated token as a client sees it."""

    id: int
    text: str                    # the text it adds (may be empty: part of a character, a hold)
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    """One sequence to generate (one choice of one request)."""

    prompt: list[int]
    sampling: Sampling
    max_tokens: int
    stop_ids: frozenset[int]           # EOS and the request's stop ids: end the sequence
    stop_strings: tuple[str, ...]
    emit: object                       # emit(kind, payload): "token" (Token) then "done" (reason)
    logprobs: bool = False             # log-probabilities wanted
    tokens: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cancelled: bool = False
    finish_reason: str | None = None
    detokenizer: Detokenizer | None = None

    def cancel(self) -> None:
        """Free the slot at the next step boundary (a client gone, a timeout)."""
        self.cancelled = True


@dataclass
class _Live:
    seq: Sequence
    start: int                         # the first slot its prompt bucket occupies


class Scheduler:
    """Drives a SlotEngine from one thread; ``submit`` from any thread."""

    def __init__(self, engine: SlotEngine, tokenizer, max_queue: int, metrics=None):
        self.engine, self.tokenizer, self.max_queue = engine, tokenizer, max_queue
        self.metrics = metrics
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.live: dict[int, _Live] = {}
        self._cv = threading.Condition()
        self._closing = False
        self._stopping = False
        self._cut = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- from any thread --------------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences together, or refuse them all."""
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self.error is not None:
                raise ShuttingDown(f"the generation loop stopped: {self.error}")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} sequences are waiting (the bound is "
                                f"{self.max_queue})")
            for seq in seqs:
                seq.detokenizer = Detokenizer(self.tokenizer, seq.stop_strings)
                self.waiting.append(seq)
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoxla-scheduler", daemon=True)
        self._thread.start()

    @property
    def closing(self) -> bool:
        """No new work is taken (the server is shutting down)."""
        return self._closing

    def close(self) -> None:
        """Take no new work (``submit`` raises ShuttingDown); what is queued or running goes on."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    def cut(self) -> None:
        """End ``stop``'s wait now: what is still queued or running is cancelled (a second
        Ctrl-C)."""
        self._cut.set()

    def stop(self, drain_seconds: float = 0.0) -> None:
        """Take no new work; let what is queued or running finish for up to ``drain_seconds``,
        then cancel the rest (each sequence ends "abort") and end the loop."""
        self.close()
        deadline = time.monotonic() + drain_seconds
        while ((self.waiting or self.live) and time.monotonic() < deadline and self._alive()
               and not self._cut.is_set()):
            self._cut.wait(0.02)
        with self._cv:
            for seq in list(self.waiting) + [live.seq for live in self.live.values()]:
                seq.cancel()
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop (one thread) ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            with backend.device_owner():
                while True:
                    with self._cv:
                        while not self._stopping and not self.waiting and not self.live:
                            self._cv.wait(timeout=0.5)
                        if self._stopping:
                            break
                    self._drop_cancelled()
                    self._admit()
                    if self.live:
                        self._step()
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            logger.exception("serving: the generation loop failed")
            self.error = e
        finally:
            with self._cv:
                pending = list(self.waiting) + [live.seq for live in self.live.values()]
                self.waiting.clear()
                self.live.clear()
            for seq in pending:
                self._finish(seq, "error" if self.error is not None else "abort")

    def _drop_cancelled(self) -> None:
        for row in [r for r, live in self.live.items() if live.seq.cancelled]:
            self._finish(self.live.pop(row).seq, "abort")
        with self._cv:
            kept = [s for s in self.waiting if not s.cancelled]
            dropped = [s for s in self.waiting if s.cancelled]
            self.waiting = collections.deque(kept)
        for seq in dropped:
            self._finish(seq, "abort")

    def _admit(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                if not self.waiting or len(self.live) >= engine.slots:
                    return
                seq = self.waiting[0]
                dropped = seq.cancelled        # cancelled since the loop's last look: no prefill
                if dropped:
                    self.waiting.popleft()
            if dropped:
                self._finish(seq, "abort")
                continue
            if engine.t + seq.max_tokens > engine.length and not self._make_room(seq):
                return                      # it waits for live rows to finish (first come first)
            with self._cv:
                self.waiting.popleft()
            row = next(r for r in range(engine.slots) if r not in self.live)
            ids = torch.tensor(seq.prompt, dtype=torch.int64)
            start = engine.t - next(p for p in engine.prompt_buckets if p >= len(seq.prompt))
            picked = engine.admit(row, ids, seq.sampling)
            self.live[row] = _Live(seq, start)
            if self.metrics is not None:
                self.metrics.admitted(seq)
            self._deliver(row, picked, 0)

    def _make_room(self, seq: Sequence) -> bool:
        """Rebase so that ``seq`` fits after the write position, if the live rows allow it."""
        engine = self.engine
        lowest = min((live.start for live in self.live.values()), default=None)
        shift = engine.t - engine.max_prompt if lowest is None else min(
            lowest, engine.t - engine.max_prompt)
        if shift <= 0 or engine.t - shift + seq.max_tokens > engine.length:
            return False
        engine.rebase(shift)
        for live in self.live.values():
            live.start -= shift
        return True

    def _step(self) -> None:
        live = [live.seq for live in self.live.values()]
        picked = self.engine.step(sample=any(s.sampling.samples for s in live),
                                  penalise=any(s.sampling.penalises for s in live),
                                  logprobs=any(s.logprobs for s in live))
        for row in list(self.live):
            self._deliver(row, picked, row)

    def _deliver(self, row: int, picked: Picked, at: int) -> None:
        """Hand ``row``'s new token (``at`` in ``picked``) to its sequence; free the slot if the
        sequence ended. A failure here (the tokenizer's, a client's callback) ends that sequence
        with an error, not the loop every other request depends on."""
        try:
            self._hand_over(row, picked, at)
        except Exception:  # noqa: BLE001 - one sequence's failure, reported to its client
            logger.exception("serving: a sequence failed; its slot is freed")
            live = self.live.pop(row, None)
            if live is not None:
                self._finish(live.seq, "error")

    def _hand_over(self, row: int, picked: Picked, at: int) -> None:
        seq = self.live[row].seq
        token = picked.tokens[at]
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.tokens.append(token)
        reason = None
        if token in seq.stop_ids:          # suppressed on the device before min_tokens
            reason = "stop"
            text = seq.detokenizer.flush()
        else:
            text, hit = seq.detokenizer.add(token, stops_allowed=len(seq.tokens) >=
                                            seq.sampling.min_tokens)
            if hit:
                reason = "stop"
            elif len(seq.tokens) >= seq.max_tokens:
                reason = "length"
                text += seq.detokenizer.flush()
        top = list(zip(picked.top_ids[at], picked.top_logprobs[at]))
        seq.emit("token", Token(token, text, picked.logprobs[at], top))
        if self.metrics is not None:
            self.metrics.token(seq, now)
        if reason is not None:
            del self.live[row]
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.metrics is not None:
            self.metrics.finished(seq)
        try:
            seq.emit("done", reason)
        except Exception:  # noqa: BLE001 - a client's callback must not stop the loop
            logger.exception("serving: a sequence's end could not be delivered")
