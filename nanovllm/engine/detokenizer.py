"""Incremental detokenization and stop strings: an output's text grows with its tokens, one step at a time.

Decoding each new token alone is wrong: a tokenizer may render a token differently depending on its neighbours
(sentencepiece's leading space), and a multi-byte character may be split over several tokens (each half decodes
to U+FFFD). So each update decodes a short window of recent tokens twice, with and without the new ones, and
appends the difference::

    ids:   ... p0 p1 p2 | n0 n1
               ^prefix_offset ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])     (already in the text)
    new_text    = decode(ids[prefix_offset:])                 -> append new_text[len(prefix_text):]

When new_text ends in U+FFFD the last character is incomplete: nothing is appended and the window waits for the
next token. The window starts with a few prompt tokens, so the first generated word gets its leading space.

Stop strings are searched in the text each new piece could have completed. Until the output finishes, the end
of the text that could still become a stop string is held back (``output_text``), so the text a caller sees
only ever grows, and never shows a stop string that is cut later.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output (and the window kept after a long catch-up).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one output sequence, fed its generated token ids in order.

    stop: stop strings; ``update`` returns the first one the text comes to contain (searched only once more than
    ``min_tokens`` tokens were generated, as vLLM does) and cuts the text there, keeping the stop string itself
    only if ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids)
        self.text = ""
        self.num_tokens = 0  # generated tokens consumed so far
        self.stop_string: str | None = None  # the stop string that ended the text, once one did
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: list[int]) -> str | None:
        """Append the text of the next generated tokens; the stop string this completes, if any (else None).

        After a stop string matched, the text is final and further tokens are ignored.
        """
        if self.stop_string is not None or self.finished or not token_ids:
            return None
        self.ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        new_text = self._decode(self.ids[self.prefix_offset:])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(self.prefix_text):
            return None  # an incomplete character (or nothing visible yet): wait for more tokens
        return self._append(new_text[len(self.prefix_text):])

    def finish(self) -> str | None:
        """The output ended: append whatever the window still holds back, incomplete characters included."""
        if self.finished:
            return None
        self.finished = True
        if self.stop_string is not None or self.read_offset == len(self.ids):
            return None
        return self._append(self._decode(self.ids[self.prefix_offset:])[len(self.prefix_text):])

    def _append(self, delta: str) -> str | None:
        # The next window: what was just read, or its last few tokens after a long catch-up of many tokens.
        self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        old_length = len(self.text)
        self.text += delta
        if self.stop and self.num_tokens > self.min_tokens:
            return self._check_stop(old_length)
        return None

    def _check_stop(self, old_length: int) -> str | None:
        """Find the earliest stop string that ends in the new text; cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # Start early enough for a match that began in the old text, late enough that it ends in the new.
            at = self.text.find(stop, max(0, old_length - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop)] if self.include_stop_str_in_output else self.text[:at]
        self.stop_string = stop
        return stop

    def output_text(self, finished: bool) -> str:
        """The text to show now: all of it once finished; before that, without any ending that may yet turn
        out to start a stop string (with include_stop_str_in_output nothing is ever cut, so nothing is held)."""
        if finished or self.stop_string is not None or not self.stop or self.include_stop_str_in_output:
            return self.text
        return self.text[:len(self.text) - self._held_back()]

    def _held_back(self) -> int:
        """Length of the longest ending of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
