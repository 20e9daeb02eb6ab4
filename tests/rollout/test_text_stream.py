"""rollout/text_stream.py: the incremental detokenizer and the stop matcher equal their naive twins."""

from __future__ import annotations

import random

from common.tokenizer import ByteTokenizer
from rollout.text_stream import IncrementalDetokenizer, StopMatcher


def _naive_first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The slow spec: the first end position where a stop completes, the longest one ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return end - len(s), s
    return None


def test_stop_matcher_fed_in_random_pieces_equals_the_naive_search():
    rng = random.Random(0)
    for _ in range(2000):
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 24)))
        m, pos = StopMatcher(stops), 0
        while pos < len(text) and m.match is None:
            k = rng.randint(1, 3)
            m.feed(text[pos : pos + k])
            pos += k
            if m.match is None:  # every suffix that may still grow into a stop is held back
                fed = text[:pos]
                could = [n for s in stops for n in range(1, len(s)) if fed.endswith(s[:n])]
                assert m.pending >= max(could, default=0)
        assert m.match == _naive_first_stop(text, stops), (stops, text)


def test_stop_matcher_without_stops_never_matches_or_holds():
    m = StopMatcher([])
    assert m.feed("anything at all") is None and m.pending == 0


def test_incremental_detokenizer_equals_decoding_everything_at_once():
    tok, rng = ByteTokenizer(), random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice(["a", " ", "é", "€", "😀", "\n"]) for _ in range(rng.randint(0, 16)))
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(rng.randint(0, 2)):  # stray bytes: invalid UTF-8 mid-stream
            ids.insert(rng.randint(0, len(ids)), rng.randint(3, 258))
        d = IncrementalDetokenizer(tok.decode)
        pieces = [d.push(i) for i in ids]
        assert "".join(pieces) + d.flush() == tok.decode(ids) == d.text, ids


def test_incremental_detokenizer_holds_a_character_until_its_last_byte():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok.decode)
    euro = tok.encode("€", add_special_tokens=False)  # 3 bytes
    assert [d.push(i) for i in euro] == ["", "", "€"]
