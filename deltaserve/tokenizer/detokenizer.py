"""IncrementalDetokenizer: token ids in, text deltas out; whole characters only, stop strings cut out."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from deltaserve.tokenizer.base import Tokenizer
from deltaserve.tokenizer.errors import TokenizerError

# An unfinished UTF-8 character is at most 3 bytes long
_MAX_PENDING_BYTES = 3


class IncrementalDetokenizer:
    """Streams one request's output text.

    It works on token bytes, so a character split over several byte-level tokens comes out once, whole, and
    the deltas add up to exactly what a full decode gives. Text that could be the start of a stop string is
    held back (at most len(longest stop) - 1 characters) until it is known not to be. A character begun by
    the prompt's last bytes and ended by the output counts as output. With min_tokens (vLLM's), a stop string
    must end in text that comes after the first min_tokens tokens: one inside their text does not stop it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._stop = _check_stop(stop or ())
        self._holdback = max(map(len, self._stop), default=1) - 1
        self._include_stop = include_stop_str_in_output
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._utf8.decode(self._prompt_tail(prompt_token_ids))
        self._prompt_pending = bool(self._utf8.getstate()[0])  # the prompt ends inside a character
        self._held = ""  # decoded text not handed out yet: it may begin a stop string
        self.output_text = ""  # all text handed out so far: the deltas joined
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output tokens pushed, special ones too (min_tokens counts them)
        self.stopped: str | None = None  # the stop string that ended the text, once one has

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that token_ids finish; "" once a stop string was found."""
        if self.stopped is not None:
            return ""
        early = max(0, min(len(token_ids), self._min_tokens - self._num_tokens))  # of the first min_tokens tokens
        self._num_tokens += len(token_ids)
        early_text = self._decode(token_ids[:early])
        return self._advance(early_text + self._decode(token_ids[early:]), final=False, protected=len(early_text))

    def finish(self) -> str:
        """The text held back until now; an unfinished character at the end becomes U+FFFD, as in decode."""
        if self.stopped is not None:
            return ""
        if self._prompt_pending:  # no output byte continued the prompt's unfinished character
            self._utf8.reset()
        text = self._utf8.decode(b"", final=True)  # the last token's: protected if it is one of the first min_tokens
        return self._advance(text, final=True, protected=len(text) if self._num_tokens <= self._min_tokens else 0)

    def _decode(self, token_ids: Sequence[int]) -> str:
        """The characters token_ids finish."""
        new_bytes = b"".join(self._tokenizer.id_to_bytes(i) for i in token_ids if i not in self._skip_ids)
        if self._prompt_pending and new_bytes:
            self._prompt_pending = False
            if not 0x80 <= new_bytes[0] < 0xC0:  # not a continuation byte: the prompt's unfinished character
                self._utf8.reset()  # stays the prompt's, and never becomes a U+FFFD of the output
        return self._utf8.decode(new_bytes)

    def _advance(self, new_text: str, final: bool, protected: int = 0) -> str:
        """Hand out new_text but what may begin a stop string; the stop strings looked for are those that end in
        new_text past its first `protected` characters (the text of the first min_tokens tokens)."""
        # every stop string ending in new_text starts inside _held, which holds the last _holdback characters; none
        # ends inside _held (it was searched, or protected, before)
        held = self._held + new_text
        found = _first_stop(held, self._stop, len(self._held) + protected)
        if found is not None:
            start, self.stopped = found
            held = held[: start + len(self.stopped) if self._include_stop else start]
        end = len(held) if final or found is not None else max(0, len(held) - self._holdback)
        delta, self._held = held[:end], held[end:]
        self.output_text += delta
        return delta

    def _prompt_tail(self, prompt_token_ids: Sequence[int]) -> bytes:
        """The prompt's last bytes: enough to hold the start of a character the output may finish."""
        tail = b""
        for token_id in reversed(prompt_token_ids):
            if len(tail) >= _MAX_PENDING_BYTES:
                break
            if token_id not in self._skip_ids:
                tail = self._tokenizer.id_to_bytes(token_id) + tail
        return tail[-_MAX_PENDING_BYTES:]


def _check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TokenizerError(
            f"stop = {stop!r:.80}, expected a list of non-empty strings; remove empty or non-string entries"
        )
    return tuple(stop)


def _first_stop(text: str, stop: tuple[str, ...], end_after: int = 0) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence ending past text[:end_after] that ends first, the longest on a tie:
    where a stream read one character at a time would have stopped, whatever the tokens' boundaries."""
    found = [(i + len(s), -len(s), i, s) for s in stop if (i := text.find(s, max(0, end_after - len(s) + 1))) >= 0]
    return min(found)[2:] if found else None
