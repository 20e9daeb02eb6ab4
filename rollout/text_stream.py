"""Token ids -> text as they are sampled, and stop strings found in that text, at a cost per token
that grows with neither the text's length nor the number of stop strings.

Why: the server streams text and ends a sample at a stop string. Re-decoding the whole output once
per stop string per token (the naive way) made 10,000 stops cost seconds per token.
`IncrementalDetokenizer` decodes only a window of the last few tokens; `StopMatcher` is an
Aho-Corasick automaton over the stops, fed each new character once.
Invariants: the concatenated pushes + flush equal `decode(all ids)` for byte-level tokenizers; a
stop match is reported at the first character where any stop string completes (the longest one
ending there), and text before `StopMatcher.pending` characters from the end can be sent safely.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"  # what decode writes for an incomplete UTF-8 sequence
_PARTIAL = 3  # ids of a character still arriving: at most 3 bytes of a 4-byte UTF-8 sequence
_MAX_HELD_TOKENS = 8  # ids held while the text ends mid-character (a UTF-8 character: <= 4 bytes)


class IncrementalDetokenizer:
    """Text of a growing list of ids, one id at a time (vLLM's prefix/read offsets): each push
    decodes the window ids[prefix:] and returns what it adds past the text already returned. A
    window ending in a replacement character may still change (the next id can complete the
    character): its text before that character is returned, the rest waits, for at most
    _MAX_HELD_TOKENS ids (a run of undecodable ids is then returned as it decodes)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids whose text is wholly in self.text
        self._ahead = 0  # characters of ids[read:]'s text already returned (the stable part)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held-back rest (replacement characters included), at the end of the sample."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        done = self.decode(self.ids[self._prefix : self._read])
        window = self.decode(self.ids[self._prefix :])
        unread = window[len(done) :]  # the text of ids[read:]
        held = len(self.ids) - self._read
        cut = len(self.ids)
        if not final and unread.endswith(REPLACEMENT):
            if held < _MAX_HELD_TOKENS:
                stable = unread.rstrip(REPLACEMENT)  # text before a trailing partial character
                new = stable[self._ahead :]
                self._ahead = max(self._ahead, len(stable))
                self.text += new
                return new
            # Held too long (a run of undecodable ids): release all but the last _PARTIAL ids (a
            # character still arriving) at an id boundary no complete character straddles.
            cut = next((k for k in range(cut - _PARTIAL, self._read, -1)
                        if window.startswith(self.decode(self.ids[self._prefix : k]))), cut)  # fmt: skip
            unread = self.decode(self.ids[self._prefix : cut])[len(done) :]
        new = unread[self._ahead :]
        self._prefix, self._read, self._ahead = self._read, cut, max(self._ahead - len(unread), 0)
        self.text += new
        return new


class StopMatcher:
    """Aho-Corasick automaton over `stops`: `feed(text)` advances over new text in O(len(text))
    amortised, whatever the number of stops; building costs O(total characters of the stops)."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        out = [-1]  # index of the longest stop that is a suffix of this state's string (-1: none)
        for k, s in enumerate(self.stops):
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    out.append(-1)
                state = nxt
            out[state] = k
        fail = [0] * len(goto)
        queue = list(goto[0].values())  # depth 1: fail to the root
        for state in queue:  # breadth-first: a state's fail link is shallower, already final
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                if out[nxt] < 0:  # not a stop itself: the longest stop among its suffixes
                    out[nxt] = out[fail[nxt]]
                queue.append(nxt)
        self._goto, self._fail, self._depth, self._out = goto, fail, depth, out
        self._reset()

    def fresh(self) -> StopMatcher:
        """A matcher at the start of a new text sharing this one's automaton (built once per
        request, not once per sample)."""
        twin = object.__new__(StopMatcher)
        twin.stops, twin._goto, twin._fail, twin._depth, twin._out = (
            self.stops, self._goto, self._fail, self._depth, self._out)  # fmt: skip
        twin._reset()
        return twin

    def _reset(self) -> None:
        self._state = 0
        self._fed = 0  # characters fed so far
        self.match: tuple[int, str] | None = None  # (start index in the fed text, stop string)

    @property
    def pending(self) -> int:
        """Characters at the end of the fed text that may still begin a stop string (hold them)."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; the first match (start index in all text fed, stop string) or None.
        After a match the matcher stops (a sample ends at its first stop)."""
        if self.match is None and self.stops:
            goto, fail, out = self._goto, self._fail, self._out
            state = self._state
            for i, ch in enumerate(text):
                while state and ch not in goto[state]:
                    state = fail[state]
                state = goto[state].get(ch, 0)
                if out[state] >= 0:
                    stop = self.stops[out[state]]
                    self.match = (self._fed + i + 1 - len(stop), stop)
                    break
            self._state = state
        self._fed += len(text)
        return self.match
