"""Shape buckets: every batch size, prompt length and cache length is padded up to one of a few
sizes, so that a new request inside a bucket reuses the programs already compiled.

Default: powers of two, at least 1 for the batch, 16 for the prompt and 64 for the cache. Pass
explicit sizes (an ascending tuple) to bound the number of programs a server can ever compile.
"""
from __future__ import annotations

from dataclasses import dataclass

POWERS_OF_TWO = "pow2"


def _check(name: str, sizes, minimum: int):
    if sizes == POWERS_OF_TWO:
        return sizes
    if (not isinstance(sizes, (tuple, list)) or not sizes
            or not all(isinstance(s, int) and s >= 1 for s in sizes)
            or list(sizes) != sorted(set(sizes))):
        raise ValueError(f"{name} must be 'pow2' or an ascending tuple of distinct positive ints, "
                         f"got {sizes!r}")
    return tuple(sizes)


@dataclass(frozen=True)
class GenerationOptions:
    """How ``model.generate`` shapes its programs; set once at load time
    (``from_pretrained(..., generation_options=GenerationOptions(...))``) or on
    ``model.autoxla_generation``.

    batch_buckets, prompt_buckets, cache_buckets: 'pow2' or ascending sizes.
    min_prompt, min_cache: the smallest power-of-two buckets.
    max_cache_len: one fixed cache length for every request (a server's usual choice: one decode
        program per batch bucket); None picks the cache bucket per request.
    stop_check_every: decode steps between two looks at the device for "every sequence finished"
        (one small device-to-host copy each); at most this many steps run after the last EOS.
    max_positions: the most positions (prompt + new tokens) one request may ask; None: the
        model's max_position_embeddings. A server sets it lower to bound every request; set it
        higher only for a model known to read past its trained positions.
    trace_steps_once: trace the prefill and the decode step once per bucket and reuse the traced
        program (generation/steps.py); False traces the model's forward on every step, as before
        (about 10 ms more host time per token on a small model; for comparison, or if a
        model's traced step ever misbehaves).
    """

    batch_buckets: object = POWERS_OF_TWO
    prompt_buckets: object = POWERS_OF_TWO
    cache_buckets: object = POWERS_OF_TWO
    min_prompt: int = 16
    min_cache: int = 64
    max_cache_len: int | None = None
    stop_check_every: int = 8
    max_positions: int | None = None
    trace_steps_once: bool = True

    def __post_init__(self):
        for name in ("batch_buckets", "prompt_buckets", "cache_buckets"):
            object.__setattr__(self, name, _check(name, getattr(self, name), 1))
        for name in ("min_prompt", "min_cache", "stop_check_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_cache_len is not None and (not isinstance(self.max_cache_len, int)
                                               or self.max_cache_len < 2):
            raise ValueError(f"max_cache_len must be an int >= 2 or None, got {self.max_cache_len!r}")
        if self.max_positions is not None and (isinstance(self.max_positions, bool) or not
                                               isinstance(self.max_positions, int)
                                               or self.max_positions < 2):
            raise ValueError(f"max_positions must be an int >= 2 or None, got {self.max_positions!r}")
        if not isinstance(self.trace_steps_once, bool):
            raise ValueError(f"trace_steps_once must be True or False, got {self.trace_steps_once!r}")

    @classmethod
    def from_any(cls, value) -> "GenerationOptions":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise TypeError(f"generation_options: unknown key(s) {sorted(unknown)}; valid: "
                                f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"generation_options must be a GenerationOptions or a dict, got "
                        f"{type(value).__name__}")

    def batch_bucket(self, batch: int) -> int:
        return bucket("batch", batch, self.batch_buckets, 1)

    def prompt_bucket(self, length: int) -> int:
        return bucket("prompt", length, self.prompt_buckets, self.min_prompt)

    def shapes(self, batch: int, length: int, max_new_tokens: int,
               padded: bool = True) -> tuple[int, int, int]:
        """(batch, prompt, cache length) of one request: each up to its bucket, or as they are
        (``padded=False``: a runtime that compiles nothing, so that a shape costs nothing)."""
        if not padded:
            self._check_room(length, max_new_tokens)
            return batch, length, length + max_new_tokens
        prompt = self.prompt_bucket(length)
        return self.batch_bucket(batch), prompt, self.cache_length(prompt, max_new_tokens)

    def cache_length(self, prompt_bucket: int, max_new_tokens: int) -> int:
        """Slots for the padded prompt and every new token."""
        if self.max_cache_len is not None:
            self._check_room(prompt_bucket, max_new_tokens)
            return self.max_cache_len
        return bucket("cache", prompt_bucket + max_new_tokens, self.cache_buckets, self.min_cache)

    def _check_room(self, prompt: int, max_new_tokens: int) -> None:
        need = prompt + max_new_tokens
        if self.max_cache_len is not None and need > self.max_cache_len:
            raise ValueError(
                f"the prompt (padded to {prompt}) plus max_new_tokens={max_new_tokens} "
                f"needs {need} cache slots, more than max_cache_len={self.max_cache_len}: "
                "ask for fewer new tokens or load with a larger max_cache_len")


def bucket(what: str, n: int, sizes, minimum: int) -> int:
    """The smallest bucket that holds ``n``."""
    if sizes == POWERS_OF_TWO:
        return max(minimum, 1 << max(0, (n - 1).bit_length()))
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"a {what} of {n} is larger than the largest {what} bucket {sizes[-1]}: "
                     f"add a bucket of at least {n} to GenerationOptions({what}_buckets=...)")
