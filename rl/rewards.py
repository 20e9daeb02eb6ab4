"""Rewards scored in child processes with a per-sample timeout.

What: `score_batch` / `ScoringPool` run any scorer `(text, truth) -> dict | float` (by default DAPO's
math reward, common/scoring.py) in worker processes, so a scorer that hangs (pathological regex,
huge input) or raises costs one sample (score -1 and an `error` field), never the batch or the caller.
Why processes: a hung thread cannot be stopped and SIGALRM cannot interrupt C code; a child process
can always be killed. Children start from a 'forkserver', which is safe inside a Ray actor.
Invariants: one dict per input, in input order, with a finite `score`, `acc` and `pred`, plus
`error` / `error_kind` (one of `ERROR_KINDS`) when the sample was not scored; the pool ships each
text's last `max_text_chars` only; the scorer must be a picklable module-level function.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from common.scoring import score_math_dapo

Scorer = Callable[[str, str], "dict[str, Any] | float"]
ErrorKind = Literal["timeout", "exception", "died", "nonfinite", "invalid_input"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("timeout", "exception", "died", "nonfinite", "invalid_input")
FAILED_SCORE = -1.0
DEFAULT_MAX_TEXT_CHARS = 1 << 20  # what the pool ships to a scorer process (the tail is kept)
STARTUP_TIMEOUT_S = 120.0  # a scorer process's start-up (imports) on a loaded machine


def _normalise(out: Any) -> dict[str, Any]:
    if isinstance(out, dict):
        score = float(out["score"])
        out = {**out, "score": score, "acc": bool(out.get("acc", score > 0)), "pred": out.get("pred")}
    else:
        score = float(out)
        out = {"score": score, "acc": score > 0, "pred": None}
    if not math.isfinite(score):
        raise _NonFinite(f"scorer returned a non-finite score {score!r}")
    return out


class _NonFinite(ValueError):
    """A scorer result of NaN or +-inf: it would poison the group's advantages."""


def _failed(error: str, kind: ErrorKind) -> dict[str, Any]:
    return {"score": FAILED_SCORE, "acc": False, "pred": None, "error": error, "error_kind": kind}


def reward_error_metrics(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """`reward/errors` (samples not scored) and `reward/errors/<kind>` for every kind (zeros too, so
    the curves exist from the first step), from `ScoringPool.score` results."""
    counts = dict.fromkeys(ERROR_KINDS, 0)
    for r in results:
        if "error" in r:
            counts[r.get("error_kind", "exception")] += 1
    return {"reward/errors": float(sum(counts.values())),
            **{f"reward/errors/{k}": float(n) for k, n in counts.items()}}  # fmt: skip


def _worker_main(conn: Connection, scorer: Scorer) -> None:
    """Child loop: say it is ready (the scorer's module is imported by now), then receive (index, text,
    truth) and send back (index, result, error, kind); None stops it."""
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe (pool closed or its process ended)
            return
        if msg is None:
            return
        i, text, truth = msg
        try:
            conn.send((i, _normalise(scorer(text, truth)), None, None))
        except _NonFinite as e:
            conn.send((i, None, str(e), "nonfinite"))
        except Exception as e:  # a scorer bug costs one sample, never the batch
            conn.send((i, None, f"{type(e).__name__}: {str(e)[:500]}", "exception"))


class ScoringPool:
    """`num_workers` scoring processes that live across calls (a RewardWorker keeps one, so no
    process start-up per step). A worker that times out or dies is killed and replaced.
    Use as a context manager, or call `close()`."""

    def __init__(
        self,
        scorer: Scorer = score_math_dapo,
        num_workers: int = 1,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {max_text_chars}")
        self.scorer, self.max_text_chars = scorer, max_text_chars
        self._ctx = mp.get_context("forkserver")
        self._procs: list[Any] = [None] * num_workers
        self._conns: list[Connection | None] = [None] * num_workers
        self.restarts = 0

    def _start(self, slot: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.scorer), daemon=True)
        proc.start()
        child.close()
        self._procs[slot], self._conns[slot] = proc, parent
        # The per-sample clock starts once the child is up: process start and the scorer's imports
        # (seconds on a loaded machine) must not eat the first sample's timeout.
        try:
            ready = parent.poll(STARTUP_TIMEOUT_S) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill(slot)
            raise RuntimeError(
                f"scorer process did not start within {STARTUP_TIMEOUT_S:g}s (cannot import the scorer "
                f"{getattr(self.scorer, '__module__', '?')}.{getattr(self.scorer, '__name__', '?')}?)"
            )

    def _kill(self, slot: int) -> None:
        proc, conn = self._procs[slot], self._conns[slot]
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()
            proc.join(timeout=5)
        self._procs[slot], self._conns[slot] = None, None

    def score(
        self,
        texts: Sequence[str],
        truths: Sequence[str],
        timeout_s: float = 5.0,
        batch_timeout_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Score every (text, truth) pair; each call of the scorer gets at most `timeout_s` seconds,
        and the whole batch at most `batch_timeout_s` (None: no batch limit; samples still waiting
        when it expires fail as timeouts), so a scorer that hangs on everything costs a bounded
        time per step, not len(texts) x timeout_s."""
        if len(texts) != len(truths):
            raise ValueError(f"{len(texts)} texts but {len(truths)} ground truths")
        if not timeout_s > 0 or (batch_timeout_s is not None and not batch_timeout_s > 0):
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, batch_timeout_s={batch_timeout_s}"
            )
        results: list[dict[str, Any] | None] = [None] * len(texts)
        pending: deque[int] = deque()
        for i, (text, truth) in enumerate(zip(texts, truths)):
            if isinstance(text, str) and isinstance(truth, str):
                pending.append(i)
            else:
                results[i] = _failed(
                    f"invalid input: text is {type(text).__name__}, ground truth is {type(truth).__name__} "
                    "(both must be str)", "invalid_input",
                )  # fmt: skip
        batch_deadline = math.inf if batch_timeout_s is None else time.monotonic() + batch_timeout_s
        busy: dict[int, tuple[int, float]] = {}  # slot -> (sample index, deadline)
        while pending or busy:
            if time.monotonic() >= batch_deadline:
                while pending:
                    results[pending.popleft()] = _failed(
                        f"timeout: the batch ran longer than {batch_timeout_s:g}s", "timeout"
                    )
            for slot in range(len(self._procs)):
                if pending and slot not in busy:
                    if self._procs[slot] is None or not self._procs[slot].is_alive():
                        self._kill(slot)
                        self._start(slot)
                    i = pending.popleft()
                    self._conns[slot].send((i, texts[i][-self.max_text_chars :], truths[i]))
                    busy[slot] = (i, min(batch_deadline, time.monotonic() + timeout_s))
            if not busy:
                continue
            next_deadline = min(d for _, d in busy.values())
            ready = wait([self._conns[s] for s in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for slot in [s for s in busy if self._conns[s] in ready]:
                i, _ = busy.pop(slot)
                try:
                    _, out, err, kind = self._conns[slot].recv()
                except (EOFError, OSError):  # the child died mid-sample (crash, os._exit, OOM kill)
                    out, err, kind = None, "scorer process died", "died"
                    self._kill(slot)
                    self.restarts += 1
                results[i] = out if err is None else _failed(err, kind)
            now = time.monotonic()
            for slot in [s for s, (_, d) in busy.items() if d <= now]:
                i, _ = busy.pop(slot)
                limit = f"{timeout_s:g}s" if now < batch_deadline else f"{batch_timeout_s:g}s (batch limit)"
                results[i] = _failed(f"timeout: scorer ran longer than {limit}", "timeout")
                self._kill(slot)
                self.restarts += 1
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for slot, conn in enumerate(self._conns):
            if conn is not None:
                with contextlib.suppress(OSError):  # the child may already be gone
                    conn.send(None)
            proc = self._procs[slot]
            if proc is not None:
                proc.join(timeout=1)
            self._kill(slot)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_batch(
    texts: Sequence[str],
    truths: Sequence[str],
    timeout_s: float = 5.0,
    *,
    scorer: Scorer = score_math_dapo,
    num_workers: int = 1,
    batch_timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Score a batch in fresh worker processes (see `ScoringPool` to keep them across calls)."""
    if not texts:
        return []
    with ScoringPool(scorer, num_workers=min(num_workers, len(texts))) as pool:
        return pool.score(texts, truths, timeout_s, batch_timeout_s)
