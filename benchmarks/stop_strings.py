"""Stop strings: cost per generated token from 1 to 10,000 stop strings, against 1 stop, same run.

Why: issue 25 measured a 256-token stream with 10,000 stops missing 30 s (the text was re-decoded
once per stop per token). The server now matches stops incrementally (rollout/text_stream.py).
Prints three tables: (1) a 256-token greedy stream through the real HTTP server (tiny model, CPU),
(2) the server's text path alone (incremental detokenizer + Aho-Corasick matcher) per token, and
(3) the engine's own per-token stop check (`SamplingParams.stop`, the naive path the trainer uses)
up to 1,000 stops, for contrast. No stop ever matches, so every run generates all its tokens.

    python benchmarks/stop_strings.py [--tokens 256] [--counts 1 10 100 1000 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, before benchmarks/rollout.py

from common.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from rollout.server import build_app
from rollout.text_stream import IncrementalDetokenizer, StopMatcher
from tests.rollout.live_server import live_server


def never_stops(count: int, seed: int = 0) -> list[str]:
    """`count` distinct stop strings of 4-40 characters that the outputs below never contain (each
    starts with the control character \\x01)."""
    rng = random.Random(seed)
    return [
        f"\x01{i}" + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(2, 38))) for i in range(count)
    ]


def server_rows(model, counts: list[int], tokens: int, repeats: int) -> list[tuple[int, float, float, str]]:
    """(stops, time to the first chunk, seconds per token after it, finish reason) per count, the
    fastest of `repeats` runs (the machine is shared: the minimum is the least disturbed)."""
    tok = ByteTokenizer()
    engine = NativeEngine(model, max_pages=128, max_batch_tokens=256, kv_dtype="fp32", index_dtype="fp32")
    app = build_app(engine, tok, model_name="tiny", max_stop_strings=max(counts), max_stop_chars=64)
    rows = []
    with live_server(app) as url:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        httpx.post(f"{url}/v1/completions", json={**body, "stop": ["\x01"]}, timeout=600)  # warm-up
        for count in counts:
            best = None
            for _ in range(repeats):
                t0 = time.perf_counter()
                stamps, last = [], None
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stop": never_stops(count)},
                              timeout=600) as r:  # fmt: skip
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.perf_counter())
                            last = json.loads(line[6:])
                # A chunk per decodable token: steady-state cost = time between the first and last chunk.
                run = (
                    count,
                    stamps[0] - t0,
                    (stamps[-1] - stamps[0]) / (tokens - 1),
                    last["choices"][0]["finish_reason"],
                )
                best = run if best is None or run[2] < best[2] else best
            rows.append(best)
    return rows


def text_path_rows(counts: list[int], tokens: int, repeats: int) -> list[tuple[int, float, float]]:
    """(stops, seconds per token, automaton build seconds) per count, fastest of `repeats`."""
    tok = ByteTokenizer()
    rng = random.Random(1)
    ids = [rng.randint(3 + 32, 3 + 126) for _ in range(tokens)]  # printable ASCII bytes
    rows = []
    for count in counts:
        stops = never_stops(count)
        t0 = time.perf_counter()
        automaton = StopMatcher(stops)
        build_s = time.perf_counter() - t0
        per = []
        for _ in range(repeats):
            matcher, detok = automaton.fresh(), IncrementalDetokenizer(tok.decode)
            t0 = time.perf_counter()
            for i in ids:
                assert matcher.feed(detok.push(i)) is None
                _ = len(detok.text) - matcher.pending  # what streaming may send
            per.append((time.perf_counter() - t0) / tokens)
        rows.append((count, min(per), build_s))
    return rows


def engine_rows(model, counts: list[int], tokens: int) -> list[tuple[int, float]]:
    tok = ByteTokenizer()
    rows = []
    for count in counts:
        engine = NativeEngine(model, max_pages=128, max_batch_tokens=256, kv_dtype="fp32", index_dtype="fp32",
                              detokenize=tok.decode)  # fmt: skip
        params = SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, stop=tuple(never_stops(count))
        )
        t0 = time.perf_counter()
        (c,) = engine.generate([Request(tuple(tok.encode("hi")), params)])
        assert len(c.token_ids) == tokens
        rows.append((count, (time.perf_counter() - t0) / tokens))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 10, 100, 1000, 10000])
    ap.add_argument("--engine-max", type=int, default=1000, help="largest count for the naive engine path")
    ap.add_argument("--repeats", type=int, default=3, help="runs per count; the fastest is shown")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()

    rows = server_rows(model, args.counts, args.tokens, args.repeats)
    base = rows[0][2]
    print(f"(1) server, {args.tokens}-token greedy stream over HTTP (tiny model, 1 CPU thread)")
    print("stops    ms/token   x 1-stop   first chunk (s)   finish")
    for count, first, per, finish in rows:
        print(f"{count:>6}  {per * 1e3:9.3f}  {per / base:9.2f}  {first:16.3f}   {finish}")
    rows = text_path_rows(args.counts, 16 * args.tokens, args.repeats)
    base = rows[0][1]
    print("\n(2) the server's text path alone (detokenize + match + hold-back), per token")
    print("stops    us/token   x 1-stop   automaton build (ms)")
    for count, per, build in rows:
        print(f"{count:>6}  {per * 1e6:9.2f}  {per / base:9.2f}  {build * 1e3:10.2f}")
    counts = [c for c in args.counts if c <= args.engine_max]
    rows = engine_rows(model, counts, args.tokens)
    base = rows[0][1]
    print("\n(3) for contrast: the engine's own stop check (SamplingParams.stop), per token")
    print("stops    ms/token   x 1-stop")
    for count, per in rows:
        print(f"{count:>6}  {per * 1e3:9.3f}  {per / base:9.2f}")


if __name__ == "__main__":
    main()
