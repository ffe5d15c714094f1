"""The OpenAI request bodies AutoXLA serves, validated once at the edge (pydantic), and what each
becomes: the prompts' token ids and each choice's generation settings.

Unknown fields are refused (a 400 naming the field) rather than ignored, and so are OpenAI
fields that would change the answer and that the server does not implement (``logit_bias``,
``tools``, ``response_format``, ``suffix``, ``echo``, ``best_of``): a client never gets an
answer to a question it did not ask. Extensions vLLM's clients send (``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``) are accepted with vLLM's meaning.

Types are strict (pydantic's strict mode on the JSON itself, ``Model.model_validate_json``): a
JSON string is not an integer (``"max_tokens": "5"``), a boolean is not a number nor a token id
(``true``, ``"prompt": [true, false]``), and numbers must be finite (``NaN``, ``Infinity`` and
overflowing literals are refused by name). The JSON must be valid Unicode: a lone surrogate
escape (``"\\ud800"``) is invalid JSON, refused before any text reaches the tokenizer.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from .engine import STOP_WIDTH
from ..generation.rows import TOP_K_LIMIT, TOP_LOGPROBS


# repetition_penalty's range: symmetric around 1 (no penalty) on a log scale. At either end the
# penalty already decides every seen token's fate for the logits models produce (|logit| < ~50,
# divided or multiplied by 100), and beyond it float32 breaks: 1e-300 rounds to 0, a division
# by zero (inf and NaN scores), and Infinity turns every seen logit into 0 or -inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _one_of(kinds: str):
    """A union's own error (pydantic lists one per member, none of them the real problem)."""
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {kinds}", {"kinds": kinds})
    return WrapValidator(validate)


Prompt = Annotated[Union[str, list[str], list[int], list[list[int]]],
                   _one_of("a string, a list of strings, a list of token ids (integers) or a list "
                           "of lists of token ids")]
Stop = Annotated[Union[str, list[str], None], _one_of("a string or a list of strings")]


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
    stop: Stop = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1, le=TOP_K_LIMIT)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0],
                                      le=REPETITION_PENALTY_RANGE[1])
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
    prompt: Prompt
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
    content: Annotated[Union[str, list[TextPart], None],
                       _one_of("a string or a list of text parts")] = None
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
