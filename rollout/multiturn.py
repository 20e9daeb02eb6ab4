"""Multi-turn episodes: many trajectories of model turns and environment (tool) turns in flight at once.

What: `run_episodes(backend, groups, tokenizer, limits, pool)` drives every trajectory of every
`EpisodeGroup` (G samples of one prompt, each with its own environment) to its end and returns one
`Trajectory` per sample: the prompt ids, every later token in order (model and environment), a
per-token `is_model` mask, the engine's log-prob of each model token, and the episode's counters.
A model turn ends at the tool-call end marker (a stop string) or EOS; the environment's reply (tool
results, rendered by `env_turn_ids`) is appended as tokens and the next turn continues the sequence.

Backends: `NativeTurns` continues the live sequence in the native engine (its KV kept, rollout/native/
engine.py `continue_sequence`); `HistoryTurns` sends the whole token history each turn to any engine
(vLLM: its prefix cache finds the history's blocks), optionally cutting turns at stop strings itself
(vLLM runs without a tokenizer here). Environment steps run in a thread pool while the engine keeps
generating for the other trajectories; tools that execute model output do so only in sandbox processes
(rollout/tools/sandbox.py), never here.

Invariants: environment tokens are never sampled and carry `is_model = 0` (the learner gives them zero
loss weight); a trajectory never exceeds `max_turns` model turns, `max_tokens_per_turn` tokens per turn
nor `max_context` tokens in all; with `deterministic` (default) an environment reply is applied exactly
one engine step (native) or one generate round (history) after its turn ended, in trajectory order, so
the trajectories depend only on the seeds, not on how fast tools ran (resumed runs replay exactly).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.tool_calls import parse_tool_calls, render_plain_message
from rollout.engine import Completion, Request, SamplingParams
from rollout.text_stream import IncrementalDetokenizer, StopMatcher
from rollout.tools.env import Environment
from rollout.tools.sandbox import is_timeout

Key = tuple[str, int]  # (request id, sample index): one trajectory


@dataclass(frozen=True)
class TurnLimits:
    """Per-recipe limits of one trajectory. `deterministic`: apply environment replies at fixed engine
    steps (see the module docstring); False applies each as soon as its tool returns (more overlap,
    trajectories then depend on tool timing)."""

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_context: int = 4096
    deterministic: bool = True

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(
                    f"rollout.multi_turn.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )


@dataclass
class EpisodeGroup:
    """G trajectories of one prompt: `envs[i]` (already `reset`) is sample i's environment."""

    request_id: str
    prompt_ids: tuple[int, ...]
    envs: list[Environment]
    params: SamplingParams  # temperature, top-p, stop ids / strings; max_tokens comes from the limits
    seed: int


@dataclass
class Trajectory:
    request_id: str
    sample_index: int
    prompt_ids: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's; 0.0 at environment tokens
    is_model: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: the environment's
    adapter_versions: list[int] = field(default_factory=list)  # per model token
    messages: list[dict[str, Any]] = field(default_factory=list)  # assistant turns and tool replies
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls and calls whose tool failed
    malformed: int = 0  # calls that did not parse
    tool_seconds: float = 0.0
    sandbox_timeouts: int = 0
    env_reward: float = 0.0
    final_text: str = ""  # what the reward scores: the last model turn, tool calls cut off
    finish_reason: str = ""  # "stop" (the episode ended), "max_turns", "length" (context or turn budget)
    env_error: str = ""

    @property
    def model_tokens(self) -> int:
        return sum(self.is_model)

    @property
    def env_tokens(self) -> int:
        return len(self.is_model) - sum(self.is_model)


# ------------------------------------------------------------------ rendering
def _has_template(tokenizer) -> bool:
    return bool(getattr(getattr(tokenizer, "tok", None), "chat_template", None))


# An episode's first prompt is `tokenizer.chat_prompt(messages, tools)` (common/tokenizer.py: the one
# chat template, tools rendered the way the server and the warm-ups render them).
def env_turn_ids(tokenizer, replies: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens that follow a model turn ending in a tool call: the end of the assistant message,
    the tool replies and whatever opens the next assistant turn. Plain template: "\\n" (the assistant
    message's end) then each reply as `render_plain_message`. A chat template: the text its rendering
    of [.., assistant, tools..] adds after the assistant's content (checked to be a pure extension)."""
    if not _has_template(tokenizer):
        text = "\n" + "".join(render_plain_message(m) for m in replies)
        return tokenizer.encode(text, add_special_tokens=False)
    tok, marker = tokenizer.tok, "\x00ASSISTANT\x00"
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    full = tok.apply_chat_template([*head, *map(dict, replies)], tokenize=False, add_generation_prompt=True)
    cut = full.find(marker)
    if cut < 0:
        raise ValueError(
            f"the chat template of {tokenizer.name!r} does not render an assistant message's content "
            "verbatim, so tool replies cannot be appended as tokens: use a template that does (or the "
            "plain one)"
        )
    return tokenizer.encode(full[cut + len(marker) :], add_special_tokens=False)


# ------------------------------------------------------------------ backends
class NativeTurns:
    """Turns on the native engine: each sample is one live sequence, parked between turns."""

    def __init__(self, engine):
        self.engine = engine

    def start(self, request: Request) -> None:
        self.engine.add_request(request, park=True)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def advance(self) -> list[Completion]:
        return self.engine.step() if self.engine.has_unfinished() else []

    def resume(self, key: Key, history: list[int], append_ids: list[int], max_tokens: int, seed: int) -> None:
        self.engine.continue_sequence(*key, append_ids, max_tokens)

    def end(self, key: Key) -> None:
        self.engine.release(*key)


class HistoryTurns:
    """Turns on any engine of the protocol (vLLM): a turn is a request holding the whole history. The
    first turn samples all G with seeds s + i; later turns are seeded from (sample seed, turn).
    `detokenize` given: stop strings are matched here (the engine gets none) and a turn is cut right
    after the token that completes one, as an engine would; the kept tokens' log-probs are unaffected."""

    def __init__(self, engine, detokenize: Callable[[list[int]], str] | None = None):
        self.engine, self.detokenize = engine, detokenize
        self._queue: list[tuple[Request, list[str], Key | None]] = []
        self._params: dict[str, SamplingParams] = {}  # request id -> its first turn's params

    def _push(self, request: Request, key: Key | None) -> None:
        stops = list(request.params.stop) if self.detokenize is not None else []
        if stops:
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, stop=()))
        self._queue.append((request, stops, key))

    def start(self, request: Request) -> None:
        self._params[request.request_id] = request.params
        self._push(request, None)

    def busy(self) -> bool:
        return bool(self._queue)

    def advance(self) -> list[Completion]:
        if not self._queue:
            return []
        queue, self._queue = self._queue, []
        outs = self.engine.generate([r for r, _, _ in queue])
        by_id = {r.request_id: (stops, key) for r, stops, key in queue}
        done = []
        for c in outs:
            stops, key = by_id[c.request_id]
            if stops:
                c = self._cut(c, stops)
            if key is not None:  # a continued turn: report it as its trajectory's
                c = dataclasses.replace(c, request_id=key[0], sample_index=key[1])
            done.append(c)
        return done

    def _cut(self, c: Completion, stops: list[str]) -> Completion:
        """`c` cut right after the token whose text completes a stop string (one pass over the tokens:
        rollout/text_stream.py's incremental detokenizer and stop matcher)."""
        detok, matcher = IncrementalDetokenizer(self.detokenize), StopMatcher(stops)
        for k, tok in enumerate(c.token_ids, start=1):
            if matcher.feed(detok.push(tok)) is not None:
                return dataclasses.replace(c, token_ids=c.token_ids[:k], logprobs=c.logprobs[:k],
                                           adapter_versions=c.adapter_versions[:k], finish_reason="stop",
                                           stop_reason=matcher.match[1])  # fmt: skip
        return c

    def resume(self, key: Key, history: list[int], append_ids: list[int], max_tokens: int, seed: int) -> None:
        params = dataclasses.replace(self._params[key[0]], max_tokens=max_tokens)
        request = Request(tuple(history) + tuple(append_ids), params, n=1, seed=seed % 2**31,
                          request_id=f"{key[0]}#{key[1]}#{seed}")  # fmt: skip
        self._push(request, key)

    def end(self, key: Key) -> None:
        pass


# ------------------------------------------------------------------ the driver
def _env_step(env: Environment, text: str) -> tuple[tuple, float]:
    """One environment step in a pool thread: (step result, seconds). An environment that raises ends
    its own trajectory (its error is recorded), never the batch."""
    t0 = time.perf_counter()
    try:
        out = env.step(text)
    except Exception as e:
        out = ([], 0.0, True, {"env_error": f"{type(e).__name__}: {e}"[:500]})
    return out, time.perf_counter() - t0


@dataclass
class _Pending:
    boundary: int
    key: Key
    future: cf.Future
    stopped_by_eos: bool


def run_episodes(backend, groups: Sequence[EpisodeGroup], tokenizer, limits: TurnLimits,
                 pool: cf.Executor) -> list[Trajectory]:  # fmt: skip
    """Every trajectory of `groups` to its end (order: group, then sample). See the module docstring."""
    trajs: dict[Key, Trajectory] = {}
    envs: dict[Key, Environment] = {}
    for g in groups:
        budget = limits.max_context - len(g.prompt_ids)
        if budget < 1:
            raise ValueError(f"prompt {g.request_id!r} has {len(g.prompt_ids)} tokens, no room left in "
                             f"rollout.multi_turn.max_context={limits.max_context}: raise it")  # fmt: skip
        for i, env in enumerate(g.envs):
            trajs[(g.request_id, i)] = Trajectory(g.request_id, i, list(g.prompt_ids), g.seed + i)
            envs[(g.request_id, i)] = env
        params = dataclasses.replace(g.params, max_tokens=min(limits.max_tokens_per_turn, budget))
        backend.start(Request(g.prompt_ids, params, n=len(g.envs), seed=g.seed, request_id=g.request_id))
    pending: list[_Pending] = []
    active, boundary = len(trajs), 0
    while active:
        finished = backend.advance()
        boundary += 1
        for c in finished:
            key = (c.request_id, c.sample_index)
            t = trajs[key]
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            t.token_ids += c.token_ids
            t.logprobs += c.logprobs.tolist()
            t.is_model += [1] * len(c.token_ids)
            t.adapter_versions += list(c.adapter_versions)
            t.turns += 1
            t.messages.append({"role": "assistant", "content": text})
            # A stop token (EOS; vLLM reports EOS as stop_reason None) ends the message and the episode.
            by_eos = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
            fut = pool.submit(_env_step, envs[key], text)
            pending.append(_Pending(boundary, key, fut, by_eos))
        if limits.deterministic:
            ready = [p for p in pending if p.boundary < boundary]
            if not backend.busy() and not ready:
                ready = list(pending)  # nothing else to run: wait for every reply
        else:
            ready = [p for p in pending if p.future.done()]
            if not backend.busy() and not ready and pending:
                cf.wait([p.future for p in pending], return_when=cf.FIRST_COMPLETED)
                ready = [p for p in pending if p.future.done()]
        if not ready and not backend.busy() and not pending and active:
            raise RuntimeError(f"{active} trajectories neither generating nor waiting for a tool (a bug)")
        for p in sorted(ready, key=lambda p: (p.boundary, p.key)):
            pending.remove(p)
            if _apply(backend, trajs[p.key], p, tokenizer, limits):
                active -= 1
    return [trajs[(g.request_id, i)] for g in groups for i in range(len(g.envs))]


def _apply(backend, t: Trajectory, p: _Pending, tokenizer, limits: TurnLimits) -> bool:
    """Record the environment's step for `t` and continue it, or end it; True if it ended."""
    (replies, reward, done, info), seconds = p.future.result()
    t.tool_calls += int(info.get("tool_calls", 0))
    t.tool_errors += int(info.get("tool_errors", 0))
    t.malformed += int(info.get("malformed", 0))
    t.tool_seconds += seconds
    t.sandbox_timeouts += sum(is_timeout(str(m.get("content", ""))) for m in replies)
    t.env_error = info.get("env_error", t.env_error)
    text = t.messages[-1]["content"]
    end = ""
    if done or p.stopped_by_eos or t.env_error:
        end = "stop"
    elif t.turns >= limits.max_turns:
        end = "max_turns"
    else:
        env_ids = env_turn_ids(tokenizer, replies)
        room = limits.max_context - len(t.prompt_ids) - len(t.token_ids) - len(env_ids)
        if room < 1:
            end = "length"
        else:
            history = t.prompt_ids + t.token_ids
            t.token_ids += env_ids
            t.logprobs += [0.0] * len(env_ids)
            t.is_model += [0] * len(env_ids)
            t.messages += [dict(m) for m in replies]
            backend.resume((t.request_id, t.sample_index), history, env_ids,
                           min(limits.max_tokens_per_turn, room), t.seed * 1_000_003 + t.turns)  # fmt: skip
            return False
    t.env_reward, t.finish_reason = float(reward), end
    t.final_text = parse_tool_calls(text)[0]
    backend.end((t.request_id, t.sample_index))
    return True
