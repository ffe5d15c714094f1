"""Token ids to text as they arrive: what each new token adds, and where a stop string ends it.

Decoding a token alone is wrong for most tokenizers (a word-piece's leading space, a character
split over byte tokens), so the whole output is decoded again and the new text is what grew; a
trailing U+FFFD (a character not finished yet) is held back until the next token completes it.
A stop string ends the text before it (OpenAI's rule: the stop string is not returned); while
the output's end could still become one, those characters are held back too.
"""
from __future__ import annotations


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
