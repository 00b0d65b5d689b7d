"""A choice's text as its tokens arrive: incremental detokenization, then stop strings, each in linear time.

``Detokenizer`` turns token ids into text deltas whose concatenation is ``tokenizer.decode(ids)`` (a
``tokenizers.Tokenizer``; ``skip_special_tokens`` as ``decode``'s default). Each step decodes a short
window, not all ids: the ids of the last delta sent (``prefix`` to ``read``) as context, then the new
ones. The delta is the window's text past the context's text. A decoder that strips the text's first
space (Llama-2's ``Strip``, ``Metaspace``) strips it from both, so it cancels; a delta is only sent when
its tokens added text, so the context never decodes to nothing but a stripped space.

Text is held back (an empty delta, the window grows) while it is not final:

* while it ends in U+FFFD: byte-level BPE (GPT-2's ``ByteLevel`` decoder) decodes all bytes at once with
  invalid sequences as U+FFFD, so a token that ends inside a character decodes to a trailing U+FFFD
  until the rest arrives. Text that does not end in U+FFFD ends on a whole character, and no later byte
  changes it.
* while the last token is a byte-fallback token ``<0x00>`` … ``<0xFF>``: Hugging Face's ``ByteFallback``
  decoder turns a run of byte tokens into its UTF-8 text, or, if the run is not valid UTF-8, into one
  U+FFFD per byte, the run's valid characters included. A later byte can still change the text of the
  whole run, so the run is sent when a token that is not a byte ends it (``▁``, a word piece). Special
  tokens do not end a run: ``decode`` drops them before the decoder sees the tokens.

With both rules the concatenated deltas equal the full decode exactly, also for invalid UTF-8 (random
ids), for these decoders combined with those that act per token or on the first one (``Replace``,
``Fuse``, ``Strip``, ``Metaspace``; WordLevel's join): tests/test_text.py checks Llama-2's, Metaspace's
and GPT-2's layouts. A decoder that rewrites text across tokens in other ways gets the window's text
past the context's length. At ``final`` the rest is sent whatever it ends in. The cost: text spelled in byte
tokens (an emoji, a character outside the vocabulary) is sent when its run ends, not character by
character. Each step decodes the window only: the last delta's ids plus those since (a run of byte tokens
is not decoded until it ends).

``StopString`` is one stop string's Knuth-Morris-Pratt automaton (its prefix function), fed each
character once: its state is the length of the longest suffix of the text fed that begins the stop
string, which is exactly how much text to hold back for it. ``TextStream`` feeds the detokenizer's deltas
to every stop string and sends the text before the largest state. The first stop string to be completed
cuts the text at its start (of two completed by the same character, the longer, which starts earlier);
nothing of it is ever sent. Work: O(text + stop string) per stop string, counted in ``StopString.steps``.
"""

from __future__ import annotations

from collections import deque

REPLACEMENT = "\ufffd"
_HEX = frozenset("0123456789abcdefABCDEF")


def is_byte_token(token: str | None) -> bool:
    """Whether a token's string is a byte-fallback token, ``<0x00>`` … ``<0xFF>``: what ``ByteFallback``
    decodes as one byte."""
    return (
        token is not None
        and len(token) == 6
        and token.startswith("<0x")
        and token.endswith(">")
        and token[3] in _HEX
        and token[4] in _HEX
    )


class Detokenizer:
    """Text deltas of one sequence's token ids (module doc). Without a tokenizer, every delta is ""."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here: the ids of the last delta sent, as context
        self.read = 0  # the ids before this are sent as text
        self.prefix_text = ""  # decode(ids[prefix:read])
        self.in_run = False  # the last token the decoder sees is a byte token
        self.decoded = 0  # ids decoded in all, for tests of the work done
        # special tokens: decode drops them before its decoder runs, so a run of byte tokens goes on across them
        added = tokenizer.get_added_tokens_decoder() if tokenizer is not None else {}
        self.hidden = frozenset(i for i, token in added.items() if token.special)

    def add(self, ids: list[int], *, final: bool = False) -> str:
        """Take the next ids; return the text they complete ("" while it is held back). With ``final``,
        return all the text not yet returned."""
        self.ids.extend(ids)
        if self.tokenizer is None or len(self.ids) == self.read:
            return ""
        for i in ids:
            if i not in self.hidden:
                self.in_run = is_byte_token(self.tokenizer.id_to_token(i))
        if not final and self.in_run:
            return ""  # inside a run of byte tokens: a later byte may change its text
        text = self._decode(self.prefix, len(self.ids))
        if not final and text.endswith(REPLACEMENT):
            return ""  # a character's bytes are not all here yet
        delta = text[len(self.prefix_text) :]
        if delta:
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self._decode(self.prefix, self.read)
        return delta

    def _decode(self, start: int, end: int) -> str:
        self.decoded += end - start
        return self.tokenizer.decode(self.ids[start:end])


class StopString:
    """One stop string's Knuth-Morris-Pratt automaton. ``state``: the length of the longest suffix of the
    text fed so far that is a prefix of the stop string. ``steps``: comparisons made, building the table
    included; at most 2 · (characters fed + the stop string's length)."""

    def __init__(self, stop: str):
        if not stop:
            raise ValueError("a stop string must not be empty")
        self.stop = stop
        self.state = 0
        self.steps = 0
        self.fail = self._prefix_function(stop)

    def _prefix_function(self, s: str) -> list[int]:
        """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
        fail = [0] * len(s)
        k = 0
        for i in range(1, len(s)):
            while k and s[k] != s[i]:
                k = fail[k - 1]
                self.steps += 1
            if s[k] == s[i]:
                k += 1
            self.steps += 1
            fail[i] = k
        return fail

    def feed(self, char: str) -> bool:
        """Advance by one character; True when the text fed now ends with the stop string."""
        q = self.state
        while q and self.stop[q] != char:
            q = self.fail[q - 1]
            self.steps += 1
        if self.stop[q] == char:
            q += 1
        self.steps += 1
        if q == len(self.stop):
            self.state = self.fail[q - 1]  # as if matching went on (overlapping matches)
            return True
        self.state = q
        return False


class TextStream:
    """A choice's text as its tokens arrive: ``add`` returns the new text, held back while it may still
    begin a stop string, cut before the first stop string completed (module doc); ``stopped`` tells
    that one was. Later calls return ""."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = [StopString(s) for s in stops]
        self.held: deque[str] = deque()  # decoded, not yet sent: it may begin a stop string
        self.stopped = False

    def add(self, ids: list[int], *, final: bool = False) -> str:
        """Take the next ids; with ``final``, send everything left before any stop string."""
        if self.stopped:
            return ""
        text = self.detokenizer.add(ids, final=final)
        stop = self._scan(text)
        if stop is not None:
            self.stopped = True
            return self._send(len(self.held) - stop)
        hold = 0 if final else max((s.state for s in self.stops), default=0)
        return self._send(len(self.held) - hold)

    def _scan(self, text: str) -> int | None:
        """Feed ``text`` to the held text and every stop string, up to the first completed; return that
        stop string's length (the longest, if several end at one character), or None."""
        for char in text:
            self.held.append(char)
            done = [len(s.stop) for s in self.stops if s.feed(char)]
            if done:
                return max(done)
        return None

    def _send(self, count: int) -> str:
        return "".join(self.held.popleft() for _ in range(count))
