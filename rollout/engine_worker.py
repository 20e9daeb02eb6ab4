"""The server's engine thread: one thread owns the engine, adds and aborts requests between steps,
turns sampled ids into text and ends samples at their stop strings.

Why a thread: the engine is not thread-safe and `step()` blocks; HTTP handlers post work to this
thread and get events back through a thread-safe callback. Stop strings are matched here
(rollout/text_stream.py, cost per token independent of their number), so the engine sees only ids.
A stop string in a request's `kept` set ends its sample with the string kept in the text (the
end of a tool-call block, which the reply's parser needs); other stop strings are cut off.
Invariants: a request fails alone when its own text handling raises; a failing `step()` drops the
requests in flight (500 each) and the engine keeps serving if it can `abort` them, else the worker
is marked broken (`health()` says why, new requests get 503); at most `max_pending` requests are in
flight (the next gets `Busy`, a 429); an aborted request leaves the engine before the next step.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.engine import Completion, Request
from rollout.text_stream import IncrementalDetokenizer, StopMatcher

# Events sent to a request's handler: ("delta", sample index, text, finish reason | None) while
# streaming, then ("done", [SampleResult, ...]) or ("error", HTTP status, message).
Event = tuple
Emit = Callable[[Event], None]


class Busy(Exception):
    """Too many requests in flight: the caller answers 429."""


class Broken(Exception):
    """The engine failed in a way it cannot recover from: the caller answers 503."""


class StepEngine(Protocol):
    def add_request(self, request: Request, on_token: Callable[[int, int, float], None]) -> str: ...
    def step(self) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...


@dataclass(frozen=True)
class SampleResult:
    """One finished sample as the HTTP response shows it."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str  # cut before the stop string that ended it, if one did (after it, for a kept one)
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop token id or stop string, if any


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    stops: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: int = 0  # characters already streamed
    result: SampleResult | None = None

    def finish(self, reason: str, stop_reason: int | str | None, cut: int | None = None) -> SampleResult:
        text = self.detok.text if cut is None else self.detok.text[:cut]
        self.result = SampleResult(self.index, self.token_ids, self.logprobs, text, reason, stop_reason)
        return self.result


@dataclass
class _Job:
    request_id: str
    samples: list[_Sample]
    emit: Emit
    stream: bool
    kept: frozenset[str] = frozenset()  # stop strings kept in the text (the rest are cut off)
    error: Exception | None = None  # set when this request's own handling raised

    def _cut(self, match: tuple[int, str]) -> int:
        start, stop = match
        return start + len(stop) if stop in self.kept else start

    def on_token(self, index: int, token_id: int, logprob: float) -> bool:
        """Record one sampled token; True if it ended the sample at a stop string."""
        s = self.samples[index]
        if s.result is not None:  # already stopped; the engine may still be finishing the step
            return False
        s.token_ids.append(token_id)
        s.logprobs.append(logprob)
        match = s.stops.feed(s.detok.push(token_id))
        if match is not None:
            self._finished(s.finish("stop", match[1], cut=self._cut(match)))
            return True
        if self.stream:
            safe = len(s.detok.text) - s.stops.pending
            if safe > s.sent:
                self.emit(("delta", index, s.detok.text[s.sent : safe], None))
                s.sent = safe
        return False

    def on_completion(self, c: Completion) -> None:
        s = self.samples[c.sample_index]
        if s.result is not None:
            return
        s.token_ids, s.logprobs = list(c.token_ids), c.logprobs.tolist()
        match = s.stops.feed(s.detok.flush())
        if match is not None:
            self._finished(s.finish("stop", match[1], cut=self._cut(match)))
        else:
            self._finished(s.finish(c.finish_reason, c.stop_reason))

    def _finished(self, r: SampleResult) -> None:
        if self.stream:
            s = self.samples[r.index]
            self.emit(("delta", r.index, r.text[s.sent :], r.finish_reason))
            s.sent = len(r.text)

    @property
    def done(self) -> bool:
        return all(s.result is not None for s in self.samples)


class EngineWorker:
    """Owns `engine` (module docstring); `decode` turns ids into text for stop strings."""

    def __init__(self, engine: StepEngine, decode: Callable[[list[int]], str], max_pending: int = 256):
        self.engine = engine
        self.decode = decode
        self.max_pending = max_pending
        self._abort_fn = getattr(engine, "abort", None)
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._jobs: dict[str, _Job] = {}
        self._in_flight = 0  # submitted and not yet done, guarded by _cv
        self._to_abort: list[tuple[str, int | None]] = []  # filled during a step, applied after it
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from handlers
    def health(self) -> str | None:
        """None when the worker can serve, else why not."""
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        return self.broken

    def submit(self, request: Request, stops: tuple[str, ...], emit: Emit, stream: bool,
               kept: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Queue `request` (its request_id set by the caller); raises Busy or Broken at once. `kept`:
        more stop strings, kept in the text when they end a sample."""
        problem = self.health()
        if problem is not None:
            raise Broken(problem)
        with self._cv:
            if self._in_flight >= self.max_pending:
                raise Busy(f"{self._in_flight} requests in flight (the server's max_pending)")
            self._in_flight += 1
        stop = StopMatcher(stops + kept)  # one automaton per request, one matcher state per sample
        samples = [_Sample(i, IncrementalDetokenizer(self.decode), stop.fresh()) for i in range(request.n)]
        job = _Job(request.request_id, samples, emit, stream, frozenset(kept))
        self._post(lambda: self._add(request, job))

    def abort(self, request_id: str) -> None:
        """Drop a request whose client left (no event is sent); applied before the next step."""
        self._post(lambda: self._drop(request_id))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the worker between steps and wait for its result."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except Exception as e:  # handed back to the caller's thread
                box["error"] = e
            ready.set()

        self._post(run)
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()

    # ------------------------------------------------------------------ the worker thread
    def _post(self, item: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def _add(self, request: Request, job: _Job) -> None:
        if self.broken is not None:
            return self._end(job, ("error", 503, f"the engine cannot serve: {self.broken}"))
        try:
            self.engine.add_request(request, lambda i, t, lp: self._on_token(job, i, t, lp))
        except ValueError as e:  # invalid for this engine (vocabulary, context, cache size)
            p = request.params
            return self._end(
                job,
                (
                    "error",
                    400,
                    f"{e} (request: prompt of {len(request.prompt_token_ids)} "
                    f"tokens, max_tokens={p.max_tokens}, n={request.n})",
                ),
            )
        except Exception as e:  # a bug reached by this request alone
            return self._end(job, ("error", 500, f"request failed: {type(e).__name__}: {e}"))
        self._jobs[job.request_id] = job

    def _on_token(self, job: _Job, index: int, token_id: int, logprob: float) -> None:
        # Runs inside engine.step(): an exception here must not escape into the engine.
        if job.error is not None:
            return
        try:
            if job.on_token(index, token_id, logprob):  # a stop string: the engine drops the sample
                self._to_abort.append((job.request_id, index))
        except Exception as e:
            job.error = e
            self._to_abort.append((job.request_id, None))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._stop or self._busy()):
                    self._cv.wait()
                if self._stop:
                    return
                items, self._inbox = self._inbox, []
            for item in items:
                item()
            if not self._busy():
                continue
            try:
                finished = self.engine.step()
            except Exception as e:  # a bug or an engine fault: drop what is in flight, keep serving
                self._fail_all(e)
                continue
            for c in finished:
                job = self._jobs.get(c.request_id)
                if job is not None and job.error is None:
                    job.on_completion(c)
            self._settle()

    def _settle(self) -> None:
        """After a step: drop stopped samples and failed requests from the engine, answer the done."""
        aborts, self._to_abort = self._to_abort, []
        for rid, index in aborts:
            if self._abort_fn is not None and rid in self._jobs:
                self._abort_fn(rid, index)
        for rid, job in list(self._jobs.items()):
            if job.error is not None:
                e = job.error
                self._drop(rid, ("error", 500, f"request failed: {type(e).__name__}: {e}"))
            elif job.done:
                del self._jobs[rid]
                self._end(job, ("done", [s.result for s in job.samples]))

    def _drop(self, request_id: str, event: Event | None = None) -> None:
        job = self._jobs.pop(request_id, None)
        if job is None:
            return
        if self._abort_fn is not None:
            self._abort_fn(request_id)
        self._end(job, event)

    def _end(self, job: _Job, event: Event | None) -> None:
        if event is not None:
            job.emit(event)
        with self._cv:
            self._in_flight -= 1

    def _busy(self) -> bool:
        return self.broken is None and self.engine.has_unfinished()

    def _fail_all(self, error: Exception) -> None:
        """Answer every request in flight with a 500 and drop it from the engine. An engine that
        cannot drop them (no `abort`, or still busy after it) is marked broken: its state is
        unknown, and stepping it again would fail forever."""
        what = f"{type(error).__name__}: {error}"
        print(f"engine step failed: {what}", file=sys.stderr)
        jobs, self._jobs, self._to_abort = self._jobs, {}, []
        for rid, job in jobs.items():
            try:
                if self._abort_fn is not None:
                    self._abort_fn(rid)
            except Exception as e:  # the engine cannot drop it: stop trusting the engine
                self.broken = f"aborting after a failed step raised {type(e).__name__}: {e}"
            self._end(
                job,
                (
                    "error",
                    500,
                    f"engine step failed ({what}); the {len(jobs)} request(s) in flight were dropped",
                ),
            )
        if self._abort_fn is None or self.engine.has_unfinished():
            self.broken = self.broken or f"a step failed ({what}) and the engine cannot drop its requests"
