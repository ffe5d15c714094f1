"""Text to token ids within a limit (``encode_within``), and token ids to text as they arrive: what
each new token adds, and where a stop string ends it.

Decoding a token alone is wrong for most tokenizers (a word-piece's leading space, a character
split over byte tokens), so the whole output is decoded again and the new text is what grew; a
trailing U+FFFD (a character not finished yet) is held back until the next token completes it.
A stop string ends the text before it (OpenAI's rule: the stop string is not returned); while
the output's end could still become one, those characters are held back too.
"""
from __future__ import annotations

# A prompt longer than this many characters per allowed token is first tokenized on a prefix of
# that length: ordinary text has 1 (CJK, digits) to 5 (English) characters per token, so the
# prefix alone already holds more tokens than allowed and the rest is never read.
CHARS_PER_TOKEN = 16


class TooLong(ValueError):
    """More tokens than allowed: ``tokens`` counted, in the first ``characters`` characters (None:
    in the whole text)."""

    def __init__(self, tokens: int, characters: int | None = None):
        super().__init__(f"{tokens} tokens")
        self.tokens, self.characters = tokens, characters


def encode_within(tokenizer, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, or ``TooLong`` if there are more than ``limit``, reading a long text
    only as far as needed: a prefix of ``CHARS_PER_TOKEN * (limit + 1)`` characters, cut where a
    word ends before whitespace, is tokenized first, and if it already has more than ``limit``
    tokens the text is refused without tokenizing the rest.

    The prefix's count is a lower bound of the whole text's for tokenizers that split words at
    whitespace before merging (byte-level BPE, SentencePiece): no token spans that cut, so the
    prefix's tokens are the text's first tokens. A text with no such cut in the prefix's second
    half (one giant word, a run of spaces) is tokenized whole: exact, and bounded by the body
    limit."""
    window = CHARS_PER_TOKEN * (limit + 1)
    if len(text) > window:
        cut = window
        while cut > window // 2 and not (text[cut].isspace() and not text[cut - 1].isspace()):
            cut -= 1
        if cut > window // 2:
            ids = tokenizer(text[:cut], add_special_tokens=add_special_tokens)["input_ids"]
            if len(ids) > limit:
                raise TooLong(len(ids), cut)
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if len(ids) > limit:
        raise TooLong(len(ids))
    return ids


class Detokenizer:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.sent = 0                 # characters of the decoded text already handed out
        self.text = ""

    def add(self, token: int, stops_allowed: bool = True) -> tuple[str, bool]:
        """(the text to hand out now, whether a stop string ended the sequence)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if stops_allowed and self.stops:
            # Search only where a stop string could newly appear.
            begin = max(0, self.sent - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, begin) for s in self.stops) if i >= 0]
            if hits:
                end = min(hits)
                out = self.text[self.sent:end] if end > self.sent else ""
                self.sent = max(self.sent, end)
                self.text = self.text[:end]
                return out, True
        ready = len(self.text)
        if self.text.endswith("\ufffd"):
            ready -= 1
        ready = min(ready, len(self.text) - self._possible_stop_tail())
        out = self.text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out, False

    def flush(self) -> str:
        """Everything not yet handed out (the sequence ended for another reason)."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _possible_stop_tail(self) -> int:
        """How many of the text's last characters are the beginning of a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
