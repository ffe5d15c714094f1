"""Serving a loaded model over HTTP (docs/serving.md): OpenAI's completions and chat completions,
continuous batching over the static KV cache's slots, Prometheus metrics.

The path of a request: ``server`` (HTTP, validation in ``protocol``) -> ``scheduler`` (a queue,
slots, stop conditions, text in ``text``) -> ``engine`` (the device programs)."""
from .server import Background, ServeConfig, Server, serve

__all__ = ["Background", "ServeConfig", "Server", "serve"]
