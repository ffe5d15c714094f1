"""The Server's app under uvicorn, with what uvicorn leaves to its users: a header timeout, the
connection limit answered in JSON, and a graceful shutdown that keeps answering.

    serve(model, tokenizer, config, host, port)          # warm up, then serve until stopped
    Background(server)                                   # the same in a thread of this process

uvicorn's own settings are used where they exist: ``limit_concurrency`` (the connection limit),
``timeout_keep_alive`` (idle keep-alive connections, its default 5 s),
``h11_max_incomplete_event_size`` (a request's head at most h11's 16 KiB, else 400),
``timeout_graceful_shutdown``. What it lacks is added here, as small as it can be:

- **A header timeout.** uvicorn arms no timer on a connection until its first response is sent
  (then the keep-alive timer), so a client that connects and sends its headers a byte at a time,
  or nothing at all, holds the connection forever. ``_protocol`` arms one from the connection (or
  from the first byte of its next request) until the request's head is complete: past
  ``header_timeout`` the connection is closed.
- **The connection limit's 503 in JSON.** Past ``limit_concurrency`` uvicorn answers a plain-text
  503; the protocol keeps the same rule and answers it as every other error here is answered.
- **Shutdown.** On SIGINT or SIGTERM uvicorn stops listening at once and then waits for the open
  requests, while the app goes on admitting new ones on open connections. ``_Web`` first tells
  the app (it answers 503 at once, and keeps listening so new connections hear it), gives running
  requests ``drain_seconds`` to finish, cuts the rest with a proper ending (Server.stop), and only
  then lets uvicorn close the listener and the connections. A second Ctrl-C cuts at once.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .server import ServeConfig, Server, error_body

# After the drain every request has its last event: this is how long uvicorn then waits for the
# handlers to send their last bytes before it cancels them.
_FLUSH_SECONDS = 5


def _protocol(header_timeout: float):
    """uvicorn's h11 protocol with a header timeout and a JSON 503 past the connection limit."""

    class Protocol(H11Protocol):
        def __init__(self, config, server_state, app_state, _loop=None):
            super().__init__(config, server_state, app_state, _loop)
            self._header_timer = None
            limit, self.limit_concurrency = self.limit_concurrency, None
            if limit is not None:
                self.app = self._limited(self.app, limit)

        def _limited(self, app, limit: int):
            """uvicorn's rule (connections or tasks at the limit), answered in JSON. Checked in
            the request's own task, which is then counted among them: hence ``>``."""
            body = json.dumps(error_body(
                f"the server has too many open connections (its limit is {limit}, "
                "--max-connections); retry shortly", None, 503)).encode()

            async def app_within_limit(scope, receive, send):
                if scope["type"] == "http" and (len(self.connections) > limit
                                                or len(self.tasks) > limit):
                    await send({"type": "http.response.start", "status": 503, "headers": [
                        (b"content-type", b"application/json"), (b"retry-after", b"1"),
                        (b"connection", b"close")]})
                    await send({"type": "http.response.body", "body": body})
                    return
                await app(scope, receive, send)
            return app_within_limit

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._awaiting_head():
                self._arm()           # the first byte of a keep-alive connection's next request
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def uvicorn_config(server: Server, host: str, port: int) -> uvicorn.Config:
    config: ServeConfig = server.config
    return uvicorn.Config(server.app(), host=host, port=port, log_level="warning",
                          http=_protocol(config.header_timeout),
                          limit_concurrency=config.connection_limit,
                          timeout_graceful_shutdown=_FLUSH_SECONDS)


class _Web(uvicorn.Server):
    """uvicorn's server, its shutdown preceded by the app's drain (the module's docstring)."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.app_server = server
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self._drain_task = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """SIGINT or SIGTERM (a signal handler, in the main thread): the first drains, a second
        cuts what is left at once (uvicorn's own handling: it then exits)."""
        if self.draining or self.loop is None:
            self.app_server.scheduler.cut()
            super().handle_exit(sig, frame)
        else:
            self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """From any thread."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.loop.run_in_executor(None, self.app_server.stop)
        finally:
            self.should_exit = True


class Background:
    """A Server's app listening in a thread of this process (notebooks, tests, benchmarks):
    ``url`` is its base (``.../v1`` for the openai client), ``stop()`` ends it gracefully."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int | None = None):
        if port is None:                     # a free port, picked by the system
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._web = _Web(uvicorn_config(server, host, port), server)
        self._thread = threading.Thread(target=self._web.run, daemon=True)
        self._thread.start()
        while not self._web.started:
            if not self._thread.is_alive():
                raise OSError(f"the server could not listen on {host}:{port}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._web.begin_shutdown()
        self._thread.join(timeout=self._web.app_server.config.drain_seconds + 120)


def serve(model, tokenizer, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
          progress: bool = True) -> None:
    """Warm up (every program compiled, with a progress bar), then serve until interrupted."""
    server = Server(model, tokenizer, config)
    compiled = server.warm_up(progress=progress)
    print(f"AutoXLA: {compiled} programs compiled; serving {config.model_name} on "
          f"http://{host}:{port}/v1 ({config.slots} slots)", flush=True)
    web = _Web(uvicorn_config(server, host, port), server)
    web.run()
    if not web.started:
        raise OSError(f"the server could not listen on {host}:{port}")
