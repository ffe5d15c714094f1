"""``autoxla serve``'s server: OpenAI's completions and chat completions over the continuous-batching
scheduler, with Starlette (routing, streaming) and Prometheus metrics; web.py runs it under
uvicorn.

    Server(model, tokenizer, ServeConfig(...)).app()     # an ASGI app

Every answer is JSON with a status code; a bad request is a 400 naming the field, a body over the
limit a 413, an unknown model a 404, a full queue a 429 with Retry-After, a stopping server a 503,
a request past its time a 504, and anything unexpected a 500 whose message says what failed,
never a traceback.

Nothing slow runs on the event loop: a large body is parsed and validated in a worker thread, and
every prompt is tokenized in one, reading a long text only as far as the token limit needs
(text.encode_within), so /health and the other clients' streams never wait for a big request.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass

import pydantic
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import backend
from ..generation.sampling import GREEDY_BELOW
from ..saving import unwrap
from .engine import Sampling, SlotEngine
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .scheduler import QueueFull, Scheduler, Sequence, ShuttingDown
from .text import TooLong, encode_within

logger = logging.getLogger("AutoXLA")


# The default body limit's allowance per prompt token: generous (a token is 1 to 5 characters of
# ordinary text, up to 6 bytes each as a JSON \u escape; a token id is at most 7 bytes with its
# comma), so that no request the other limits accept is refused for its size.
BODY_BYTES_PER_TOKEN = 16
# JSON bodies larger than this are parsed and validated in a worker thread, not on the event loop.
_THREAD_PARSE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServeConfig:
    """What the server allows and how it batches; checked once here.

    slots: sequences decoded together (the batch of every decode step).
    max_prompt_tokens: the longest prompt (its bucket: prompts are padded to powers of two from
        16 up to it, one prefill program each).
    max_tokens: the most new tokens one sequence may ask.
    max_queue: sequences waiting for a slot before new requests get 429; a request of more
        sequences than this (prompts x n) could never be admitted and is a 400.
    request_timeout: seconds a request may take, queue wait included (then 504, slot freed).
    drain_seconds: on shutdown (Ctrl-C, SIGTERM), how long running requests get to finish
        before they are cut; new requests get 503 at once.
    default_max_tokens: for a completion that names no max_tokens (OpenAI's default is 16).
    max_body_bytes: the largest request body (413 beyond it, refused before it is read); None:
        ``BODY_BYTES_PER_TOKEN`` bytes per token of a full queue of the longest prompts
        (``max_queue * max_prompt_tokens``), at least 1 MiB (``body_limit``).
    header_timeout: seconds a connection may take to send a request's headers (from connecting,
        or from the first byte of its next request) before it is closed; a pause as long inside
        a body ends the request with 408.
    max_connections: open connections served at once; a request on one more gets 503. None:
        ``slots + max_queue + 64`` (every admitted or queued request, and room for health checks
        and idle keep-alive connections; ``connection_limit``).
    """

    slots: int = 8
    max_prompt_tokens: int = 512
    max_tokens: int = 256
    max_queue: int = 256
    request_timeout: float = 600.0
    drain_seconds: float = 30.0
    default_max_tokens: int = 16
    model_name: str = "autoxla"
    max_body_bytes: int | None = None
    header_timeout: float = 10.0
    max_connections: int | None = None

    def __post_init__(self):
        for name in ("slots", "max_prompt_tokens", "max_tokens", "max_queue",
                     "default_max_tokens", "max_body_bytes", "max_connections"):
            value = getattr(self, name)
            if value is None and name in ("max_body_bytes", "max_connections"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve: {name} must be a positive int, got {value!r}")
        for name in ("request_timeout", "drain_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"serve: {name} must be >= 0 seconds")
        if not self.header_timeout > 0:
            raise ValueError(f"serve: header_timeout must be > 0 seconds, got "
                             f"{self.header_timeout!r}")

    @property
    def body_limit(self) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(1 << 20, BODY_BYTES_PER_TOKEN * self.max_queue * self.max_prompt_tokens)

    @property
    def connection_limit(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return self.slots + self.max_queue + 64

    @property
    def prompt_buckets(self) -> tuple[int, ...]:
        sizes, size = [], 16
        while size < self.max_prompt_tokens:
            sizes.append(size)
            size *= 2
        return (*sizes, self.max_prompt_tokens)

    @property
    def cache_length(self) -> int:
        """Room for the largest prompt and two of the longest answers: after a rebase the oldest
        live sequence spans at most one prompt and one answer, so a new one always fits."""
        return self.max_prompt_tokens + 2 * self.max_tokens


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 headers: dict | None = None, code: str | int | None = None):
        super().__init__(message)
        self.param, self.status, self.headers, self.code = param, status, headers or {}, code


class ClientGone(Exception):
    """The client disconnected before its answer: nobody to answer (recorded as 499, nginx's
    "client closed request")."""


# Sent with an answer given before the body was read whole (413, 408): the connection is closed
# after it, so the rest of the body is neither read nor waited for.
_CLOSE = {"Connection": "close"}


class Server:
    def __init__(self, model, tokenizer, config: ServeConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or ServeConfig()
        hf = unwrap(model)
        self.max_positions = getattr(hf.config.get_text_config(), "max_position_embeddings",
                                     None)
        self.eos_ids = eos_token_ids(hf)
        self.engine = SlotEngine(model, config.slots, config.cache_length,
                                 config.prompt_buckets)
        self.metrics = Metrics(lambda: self.scheduler.queue_depth,
                               lambda: len(self.scheduler.live))
        self.scheduler = Scheduler(self.engine, tokenizer, config.max_queue, self.metrics)
        self.created = int(time.time())
        self._random = random.Random()
        self.warmed_up = False

    # -- start and stop ------------------------------------------------------------------------
    def warm_up(self, progress: bool = True) -> int:
        """Compile every program traffic can need (a prefill per prompt bucket, the eight steps,
        the rebase); the number compiled."""
        from tqdm.auto import tqdm

        before = backend.compile_count()
        engine = self.engine
        with backend.device_owner():
            for bucket in tqdm(engine.prompt_buckets, desc="AutoXLA: compiling", unit="bucket",
                               disable=not progress):
                engine.admit(0, torch_ids(bucket), Sampling())
            for flags in itertools.product((False, True), repeat=3):
                engine.step(*flags)
            engine.rebase(engine.t - engine.max_prompt)
        self.warmed_up = True
        return backend.compile_count() - before

    def start(self) -> None:
        if not self.warmed_up:
            self.warm_up(progress=False)
        self.scheduler.start()

    def stop(self) -> None:
        """Graceful: new requests get 503 at once; queued and running ones get
        ``drain_seconds`` to finish; then the rest are cut (a stream ends with finish_reason
        "abort", an error event and [DONE]; a whole answer is a 503) and the loop ends."""
        self.scheduler.stop(self.config.drain_seconds)

    @property
    def closing(self) -> bool:
        return self.scheduler.closing

    # -- the app ---------------------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self._endpoint("completions", self.completions),
                        methods=["POST"]),
                  Route("/v1/chat/completions", self._endpoint("chat", self.chat),
                        methods=["POST"]),
                  Route("/v1/models", self._endpoint("models", self.models), methods=["GET"]),
                  Route("/health", self._endpoint("health", self.health), methods=["GET"]),
                  Route("/metrics", self.render_metrics, methods=["GET"])]

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.stop)

        return Starlette(routes=routes, lifespan=lifespan)

    def _endpoint(self, name: str, handler):
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except BadRequest as e:
                response = error(e.status, str(e), e.param, e.headers, e.code)
            except ClientGone:
                response = Response(status_code=499)    # sent to no one
            except Exception as e:  # noqa: BLE001 - an answer, never a traceback
                logger.exception("serving: %s failed", name)
                response = error(500, f"internal error: {type(e).__name__}: {e}")
            finally:
                watch = getattr(request.state, "watch", None)
                if watch is not None:      # a stream's disconnect is Starlette's to hear now
                    watch.close()
                if getattr(request.state, "large", False):
                    asyncio.get_running_loop().run_in_executor(None, release_memory)
            self.metrics.answered(name, response.status_code)
            return response
        return endpoint

    async def health(self, request: Request) -> Response:
        if self.scheduler.error is not None:
            return error(503, f"the generation loop stopped: {self.scheduler.error}")
        if self.closing:
            return error(503, "the server is shutting down")
        return JSONResponse({"status": "ok", "slots": self.config.slots,
                             "slots_in_use": len(self.scheduler.live),
                             "queue_depth": self.scheduler.queue_depth})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created,
            "owned_by": "autoxla", "max_model_len": self.config.max_prompt_tokens +
            self.config.max_tokens}]})

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def completions(self, request: Request) -> Response:
        body = await self._request(request, CompletionRequest)
        p = body.prompt
        self._check_count(1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p),
                          body.n)
        prompts = await run_in_threadpool(self._completion_prompts, body)
        return await self._answer(request, body, prompts, chat=False,
                                  max_tokens=body.max_tokens or self.config.default_max_tokens,
                                  logprobs=body.logprobs)

    async def chat(self, request: Request) -> Response:
        body = await self._request(request, ChatCompletionRequest)
        self._check_count(1, body.n)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: use /v1/completions",
                             "messages")
        ids = await run_in_threadpool(self._chat_prompt, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:       # as vLLM: what the limits leave
            max_tokens = min(self.config.max_tokens, self._position_room(len(ids)))
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return await self._answer(request, body, [ids], chat=True, max_tokens=max_tokens,
                                  logprobs=(top or 0) if body.logprobs else None)

    # -- one request -------------------------------------------------------------------------
    async def _request(self, request: Request, model):
        """The request's body as ``model``: refused at once while shutting down (503), past the
        body limit (413) or for another model than this server's (404). From then on the
        client's disconnect is watched (``request.state.watch``)."""
        if self.closing:
            raise BadRequest("the server is shutting down", status=503)
        raw = await read_body(request, self.config.body_limit, self.config.header_timeout)
        request.state.watch = _Watch(request)
        if len(raw) > _THREAD_PARSE_BYTES:
            request.state.large = True
            body = await run_in_threadpool(parse, raw, model)
        else:
            body = parse(raw, model)
        if body.model is not None and body.model != self.config.model_name:
            raise BadRequest(f"the model `{body.model}` does not exist: this server serves "
                             f"`{self.config.model_name}` (GET /v1/models)", "model", status=404,
                             code="model_not_found")
        return body

    def _check_count(self, prompts: int, n: int) -> None:
        """A request of more sequences than the queue holds could never be admitted: a 400, not
        a 429 to retry forever."""
        limit = self.config.max_queue
        if prompts * n > limit:
            raise BadRequest(f"this request asks for {prompts * n} sequences ({prompts} "
                             f"prompt{'s' if prompts != 1 else ''} x n={n}), more than this "
                             f"server's queue holds ({limit}, --max-queue): it could never be "
                             "admitted; send fewer prompts or a smaller n", "n")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        limit = self.config.max_prompt_tokens
        try:
            return encode_within(self.tokenizer, text, limit, add_special_tokens)
        except TooLong as e:
            where = ("the prompt has" if e.characters is None else
                     f"the prompt's first {e.characters} characters already have")
            raise BadRequest(f"{where} {e.tokens} tokens, more than this server's limit of "
                             f"{limit} (--max-prompt-tokens)", param)

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The prompts' token ids (a worker thread: tokenizing is not for the event loop)."""
        p = body.prompt
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)
        elif p and all(isinstance(x, int) for x in p):
            return [self._check_ids(list(p))]
        elif p and all(isinstance(x, list) for x in p):
            return [self._check_ids(list(x)) for x in p]
        else:
            raise BadRequest("prompt is empty", "prompt")
        out = []
        for text in texts:
            ids = self._encode(text, True, "prompt")
            if not ids:
                raise BadRequest("prompt is empty: nothing to continue", "prompt")
            out.append(ids)
        return out

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template applied and tokenized (a worker thread)."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own complaint, as a 400
            raise BadRequest(f"the chat template refused these messages: {e}", "messages")
        return self._encode(text, False, "messages")

    def _check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.vocab
        if not ids or any(not 0 <= i < vocab for i in ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab}) and not empty", "prompt")
        limit = self.config.max_prompt_tokens
        if len(ids) > limit:
            raise BadRequest(f"the prompt has {len(ids)} tokens, more than this server's "
                             f"limit of {limit} (--max-prompt-tokens)", "prompt")
        return ids

    def _position_room(self, prompt: int) -> int:
        return (self.max_positions - prompt) if self.max_positions else self.config.max_tokens

    def _sequences(self, body, prompts, max_tokens: int, emit_for,
                   logprobs: bool) -> list[Sequence]:
        bad = body.unsupported()
        if bad:
            raise BadRequest(f"{bad[0]} is not supported by this server; drop it", bad[0])
        if max_tokens < 1:
            raise BadRequest("the prompt leaves no room for an answer within the model's "
                             f"{self.max_positions} positions", "messages")
        if max_tokens > self.config.max_tokens:
            raise BadRequest(f"max_tokens={max_tokens} is more than this server's limit of "
                             f"{self.config.max_tokens} (--max-tokens)", "max_tokens")
        for ids in prompts:
            if self.max_positions and len(ids) + max_tokens > self.max_positions:
                raise BadRequest(f"the prompt's {len(ids)} tokens plus max_tokens={max_tokens} "
                                 f"exceed the model's {self.max_positions} positions", "max_tokens")
        try:
            stops = body.stop_strings()
        except ValueError as e:
            raise BadRequest(str(e), "stop")
        vocab = self.engine.vocab
        if any(not 0 <= i < vocab for i in body.stop_token_ids):
            raise BadRequest(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if body.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens={body.min_tokens} is more than max_tokens={max_tokens}",
                             "min_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        greedy = temperature < GREEDY_BELOW         # 0, and what float32 cannot divide by
        base_seed = body.seed if body.seed is not None else self._random.randrange(2**31)
        eos = () if body.ignore_eos else self.eos_ids
        stop_ids = tuple(dict.fromkeys((*eos, *body.stop_token_ids)))
        seqs = []
        for i, ids in enumerate(prompts):
            for j in range(body.n):
                sampling = Sampling(
                    greedy=greedy, temperature=1.0 if greedy else temperature,
                    top_k=max(body.top_k, 0), top_p=1.0 if body.top_p is None else body.top_p,
                    seed=(base_seed + j) % 2**32, min_tokens=body.min_tokens,
                    repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, stop_token_ids=stop_ids)
                seqs.append(Sequence(list(ids), sampling, max_tokens, frozenset(stop_ids), stops,
                                     emit_for(i * body.n + j), logprobs))
        return seqs

    async def _answer(self, request: Request, body, prompts, chat: bool, max_tokens: int,
                      logprobs: int | None) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit_for(index):
            def emit(kind, payload):
                loop.call_soon_threadsafe(events.put_nowait, (index, kind, payload))
            return emit

        seqs = self._sequences(body, prompts, max_tokens, emit_for, logprobs is not None)
        watch = request.state.watch
        if watch.gone:                 # gone while its prompt was read: never queued
            raise ClientGone
        watch.on_gone = lambda: _cancel(self.scheduler, seqs)    # queued or running: freed
        try:
            self.scheduler.submit(seqs)
        except QueueFull as e:
            raise BadRequest(f"the server is busy: {e}; retry shortly", status=429,
                             headers={"Retry-After": "1"})
        except ShuttingDown as e:
            raise BadRequest(str(e), status=503)
        reply = _Reply(self, body, seqs, chat, logprobs)
        if body.stream:
            return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole(events, watch)


def _cancel(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        if seq.finish_reason is None:
            seq.cancel()
    scheduler.wake()


class _Watch:
    """Listens for the client's disconnect once its body is read (uvicorn reports it as the next
    ASGI message): ``gone``, and ``on_gone`` called. A whole answer's client is heard only this
    way while its sequences wait or run, so its slots are freed at once, as a stream's are."""

    def __init__(self, request: Request):
        self.gone = False
        self.on_gone = None
        self._task = asyncio.ensure_future(self._run(request.receive))

    async def _run(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self.on_gone is not None:
            self.on_gone()

    def close(self) -> None:
        self._task.cancel()


class _Reply:
    """The answer to one request: its sequences' events gathered into OpenAI's JSON or chunks."""

    def __init__(self, server: Server, body, seqs: list[Sequence], chat: bool, logprobs):
        self.server, self.body, self.seqs, self.chat = server, body, seqs, chat
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [""] * len(seqs)
        self.tokens: list[list] = [[] for _ in seqs]
        self.deadline = time.monotonic() + server.config.request_timeout

    def cancel(self) -> None:
        _cancel(self.server.scheduler, self.seqs)

    def _cut_by_shutdown(self, reasons) -> bool:
        return "abort" in reasons and self.server.closing

    def _shutdown_message(self) -> str:
        return (f"the server shut down before this request finished (running requests get "
                f"{self.server.config.drain_seconds:g} s, --drain-seconds)")

    async def _events(self, events: asyncio.Queue):
        """Yield (index, kind, payload) until every sequence is done; past the deadline the
        rest are cancelled and TimeoutError raised."""
        done = 0
        while done < len(self.seqs):
            try:
                item = await asyncio.wait_for(events.get(),
                                              timeout=max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.cancel()
                raise TimeoutError
            if item[1] == "done":
                done += 1
            yield item

    async def whole(self, events, watch: _Watch) -> Response:
        reasons = [None] * len(self.seqs)
        try:
            async for index, kind, payload in self._events(events):
                if kind == "token":
                    self.texts[index] += payload.text
                    self.tokens[index].append(payload)
                else:
                    reasons[index] = payload
        except TimeoutError:
            raise BadRequest(f"the request took longer than the server's "
                             f"{self.server.config.request_timeout:g} s limit", status=504)
        except asyncio.CancelledError:
            self.cancel()
            raise
        if watch.gone:
            raise ClientGone
        if any(r == "error" for r in reasons):
            why = self.server.scheduler.error or "see the server's log"
            raise BadRequest(f"generation failed: {why}", status=500)
        if self._cut_by_shutdown(reasons):
            raise BadRequest(self._shutdown_message(), status=503)
        choices = [self._choice(i, self.texts[i], self.tokens[i], reasons[i], whole=True)
                   for i in range(len(self.seqs))]
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else
                             "text_completion", "created": self.created,
                             "model": self.server.config.model_name, "choices": choices,
                             "usage": self._usage()})

    async def stream(self, events):
        """The chunks; a client gone mid-stream is Starlette's to hear (it cancels this
        generator, whose ``finally`` frees the slots)."""
        first = [True] * len(self.seqs)
        reasons = [None] * len(self.seqs)
        try:
            async for index, kind, payload in self._events(events):
                if kind == "token":
                    self.tokens[index].append(payload)
                    self.texts[index] += payload.text
                    choice = self._choice(index, payload.text, [payload], None, whole=False,
                                          first=first[index])
                else:
                    reasons[index] = payload
                    choice = self._choice(index, "", [], payload, whole=False,
                                          first=first[index])
                first[index] = False
                yield self._chunk([choice])
            if self._cut_by_shutdown(reasons):
                yield "data: " + json.dumps(error_body(self._shutdown_message(), None,
                                                       503)) + "\n\n"
            elif "error" in reasons:
                why = self.server.scheduler.error or "see the server's log"
                yield "data: " + json.dumps(error_body(f"generation failed: {why}", None,
                                                       500)) + "\n\n"
            else:
                options = self.body.stream_options
                if options is not None and options.include_usage:
                    yield self._chunk([], usage=self._usage())
        except TimeoutError:
            yield "data: " + json.dumps(error_body(
                f"the request took longer than the server's "
                f"{self.server.config.request_timeout:g} s limit", None, 504)) + "\n\n"
        finally:
            self.cancel()           # a client gone mid-stream frees its slots at once
        yield "data: [DONE]\n\n"

    def _chunk(self, choices, usage=None) -> str:
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else
                "text_completion", "created": self.created,
                "model": self.server.config.model_name, "choices": choices}
        if usage is not None:
            data["usage"] = usage
        return "data: " + json.dumps(data) + "\n\n"

    def _choice(self, index, text, tokens, reason, whole: bool, first: bool = False) -> dict:
        reason = {"abort": "abort", "error": "error"}.get(reason, reason)
        logprobs = self._logprobs(tokens) if self.logprobs is not None else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if whole:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": reason}
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text or reason is None else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, tokens) -> dict:
        decode = self.server.tokenizer.decode
        n = self.logprobs or 0
        if self.chat:
            return {"content": [{
                "token": decode([t.id]), "logprob": t.logprob, "bytes": list(decode([t.id])
                                                                              .encode()),
                "top_logprobs": [{"token": decode([i]), "logprob": lp,
                                  "bytes": list(decode([i]).encode())} for i, lp in t.top[:n]]}
                for t in tokens]}
        return {"tokens": [decode([t.id]) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{decode([i]): lp for i, lp in t.top[:n]} for t in tokens]}

    def _usage(self) -> dict:
        prompt = sum(len(s.prompt) for s in self.seqs[::self.body.n])
        completion = sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


# A refused body is read on and thrown away, up to these bounds, before the 413 is sent.
DISCARD_BYTES = 1 << 30
DISCARD_SECONDS = 5.0


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass ``limit`` bytes: from
    its Content-Length before a byte of it is kept, else (chunked) while the chunks are counted;
    a pause of ``timeout`` seconds between two chunks is a 408. Both close the connection.

    Most clients (Python's http.client, httpx and so the openai client) send a whole body before
    they read an answer, and the close that follows an answer sent while they are still writing
    resets their connection: they would see "connection reset", not the 413. So, as nginx's
    lingering close does, the rest of a refused body is received and dropped (nothing is kept;
    other requests go on meanwhile) for at most ``DISCARD_BYTES`` or ``DISCARD_SECONDS``, then
    the 413 is sent. A client that sent ``Expect: 100-continue`` has sent no body yet: it is
    answered at once, and never sends it.

    Starlette's own limit (``Route(max_body_size=...)``) answers any response to such a request
    with its plain-text 413; every error here is JSON, so the same two checks are made here."""
    too_large = BadRequest(f"the request body is larger than this server's limit of {limit} "
                           "bytes (--max-body-bytes)", status=413, headers=_CLOSE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        if request.headers.get("expect", "").lower() != "100-continue":
            await _discard_body(request)
        raise too_large
    body = bytearray()
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), timeout)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body stalled: nothing arrived for {timeout:g} s "
                             "(--header-timeout)", status=408, headers=_CLOSE)
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            del body
            if message.get("more_body", False):
                await _discard_body(request)
            raise too_large
        if not message.get("more_body", False):
            return bytes(body)


async def _discard_body(request: Request) -> None:
    """Receive what is left of the body and drop it, within DISCARD_BYTES and DISCARD_SECONDS."""
    deadline, dropped = time.monotonic() + DISCARD_SECONDS, 0
    while dropped < DISCARD_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(request.receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            raise ClientGone
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def parse(raw: bytes, model):
    """``raw`` as ``model`` (JSON parsed and validated by pydantic in strict mode), or a 400
    naming the field and what is wrong with it."""
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        first = e.errors(include_url=False)[0]
        kind = first["type"]
        if kind == "json_invalid":
            why = first["ctx"]["error"] if "ctx" in first else first["msg"]
            hint = (": a \\ud800-\\udfff escape must be half of a surrogate pair (text must be "
                    "valid Unicode)" if "surrogate" in why or "hex escape" in why else "")
            raise BadRequest(f"the body is not valid JSON: {why}{hint}")
        if kind == "model_type" and not first["loc"]:
            raise BadRequest("the body must be a JSON object")
        field = ".".join(str(p) for p in first["loc"]) or None
        if kind == "extra_forbidden":
            message = "unknown field"
        else:
            message = first["msg"].replace("Input should be", "must be")
            if "input" in first and kind != "missing":
                message += f" (got {_brief(first['input'])})"
        raise BadRequest(f"{field}: {message}" if field else message, field)


def _brief(value) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, bytearray)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def error_body(message: str, param: str | None, status: int,
               code: str | int | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 408: "timeout",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable",
            504: "timeout"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code}}


def error(status: int, message: str, param: str | None = None, headers: dict | None = None,
          code: str | int | None = None):
    return JSONResponse(error_body(message, param, status, code), status_code=status,
                        headers=headers)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_memory() -> None:
    """Hand the heap a large request freed back to the system: glibc keeps the pages of the
    worker threads' arenas otherwise (a 1 MB body's JSON and tokens kept ~100 MB of RSS after
    it was answered; malloc_trim returns them). Elsewhere than glibc, nothing."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def eos_token_ids(hf) -> tuple[int, ...]:
    """The checkpoint's EOS ids (its generation config's, else its config's)."""
    eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(hf.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def torch_ids(length: int):
    import torch

    return torch.ones(length, dtype=torch.int64)
