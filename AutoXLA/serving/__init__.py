"""Serving a loaded model over HTTP (docs/serving.md): OpenAI's completions and chat completions,
continuous batching over the static KV cache's slots, Prometheus metrics.

The path of a request: ``web`` (uvicorn: connections, timeouts, shutdown) -> ``server`` (HTTP,
validation in ``protocol``) -> ``scheduler`` (a queue, slots, stop conditions, text in ``text``)
-> ``engine`` (the device programs)."""
from .server import ServeConfig, Server
from .web import Background, serve

__all__ = ["Background", "ServeConfig", "Server", "serve"]
