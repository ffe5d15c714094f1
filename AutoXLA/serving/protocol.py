"""The OpenAI request bodies AutoXLA serves, validated once at the edge (pydantic), and what each
becomes: the prompts' token ids and each choice's generation settings.

Unknown fields are refused (a 400 naming the field) rather than ignored, and so are OpenAI
fields that would change the answer and that the server does not implement (``logit_bias``,
``tools``, ``response_format``, ``suffix``, ``echo``, ``best_of``): a client never gets an
answer to a question it did not ask. Extensions vLLM's clients send (``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``) are accepted with vLLM's meaning.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .engine import STOP_WIDTH
from ..generation.rows import TOP_K_LIMIT, TOP_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1, le=TOP_K_LIMIT)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=STOP_WIDTH - 2)
    ignore_eos: bool = False
    # accepted only at the value that changes nothing
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ValueError("stop: at most 4 stop strings (OpenAI's limit)")
        if any(not s for s in stops):
            raise ValueError("stop: an empty stop string would end every answer at once")
        return tuple(stops)

    def unsupported(self) -> list[str]:
        return ["logit_bias"] if self.logit_bias else []


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name, bad in (("echo", self.echo), ("suffix", self.suffix),
                                       ("best_of", self.best_of not in (None, self.n))) if bad]
        return out


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: object = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name, bad in (("tools", self.tools), ("tool_choice", self.tool_choice
                                                              not in (None, "none")),
                                       ("response_format", self.response_format and
                                        self.response_format.get("type") != "text")) if bad]
        return out
