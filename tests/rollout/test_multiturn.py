"""rollout/multiturn.py on the tiny model (CPU, fp32 cache) with real environments: the native
continuation and the whole-history backend give the same trajectories; tool steps run in parallel
with generation and, in deterministic mode, slow or jittery tools do not change the trajectories;
the turn, token and context limits hold; tool errors and sandbox timeouts are counted."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest

import rollout.tools.calculator
import rollout.tools.sandbox  # registers python (calculator: the line above)
from common.tokenizer import ByteTokenizer
from common.tool_calls import TOOL_CALL_END, ToolCall, render_tool_calls
from rollout import multiturn
from rollout.engine import SamplingParams
from rollout.native import NativeEngine
from rollout.tools.env import ToolEnv
from tests.rollout.tiny_models import build

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


class ReplyEnv:
    """Answers every model turn with a tool message (its turn number and the turn's length), for
    `turns` turns; optionally sleeping `delay()` seconds first (a slow tool)."""

    def __init__(self, turns: int = 3, delay=lambda: 0.0):
        self.turns, self.delay, self.seen = turns, delay, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        time.sleep(self.delay())
        self.seen += 1
        done = self.seen >= self.turns
        reply = [] if done else [{"role": "tool", "content": f"t{self.seen}:{len(text)}"}]
        return reply, 1.0 if done else 0.0, done, {"tool_calls": 1, "tool_errors": 0}


@pytest.fixture(scope="module")
def model():
    return build()


def engine(model, **kw):
    kw.setdefault("max_pages", 256)
    return NativeEngine(model, kv_dtype="fp32", index_dtype="fp32", detokenize=TOK.decode, **kw)


def groups(n_prompts=3, n=2, temperature=0.0, make_env=ReplyEnv, stop=()):
    params = SamplingParams(temperature=temperature, stop_token_ids=(TOK.eos_token_id,), stop=stop)
    out = []
    for k in range(n_prompts):
        msgs = [{"role": "user", "content": f"{17 * k + 3}*{k + 11}="}]
        envs = [make_env() for _ in range(n)]
        for e in envs:
            e.reset({"prompt": msgs[0]["content"], "answer": "0"})
        out.append(multiturn.EpisodeGroup(f"p{k}", tuple(TOK.chat_prompt(msgs)), envs, params,
                                          seed=100 * k))  # fmt: skip
    return out


LIMITS = multiturn.TurnLimits(max_turns=4, max_tokens_per_turn=8, max_context=200)


def run(backend, gs, limits=LIMITS, workers=8):
    with cf.ThreadPoolExecutor(workers) as pool:
        return multiturn.run_episodes(backend, gs, TOK, limits, pool)


def view(trajs):
    return [(t.request_id, t.sample_index, t.token_ids, t.is_model, t.turns, t.finish_reason) for t in trajs]


def test_native_continuation_and_whole_history_backend_give_the_same_trajectories(model):
    native_engine = engine(model)
    native = run(multiturn.NativeTurns(native_engine), groups())
    history = run(multiturn.HistoryTurns(engine(model), detokenize=TOK.decode), groups())
    assert view(native) == view(history)
    for a, b in zip(native, history, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    t = native[0]
    assert t.turns == 3 and t.finish_reason == "stop" and t.tool_calls == 3
    # Model turns of 8 tokens, the environment's replies between them, rendered by the plain template.
    assert [m["role"] for m in t.messages] == ["assistant", "tool"] * 2 + ["assistant"]
    env1, env2 = (len(multiturn.env_turn_ids(TOK, [t.messages[i]])) for i in (1, 3))
    assert t.is_model == [1] * 8 + [0] * env1 + [1] * 8 + [0] * env2 + [1] * 8
    assert TOK.decode(t.token_ids).count("<tool_response>t1:") == 1
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.is_model, strict=True) if not m)
    assert native_engine.num_parked == 0 and native_engine.stats().pages_in_use == 0


def test_tools_run_in_parallel_and_deterministic_mode_ignores_their_timing(model):
    rng = random.Random(0)
    slow = lambda: ReplyEnv(delay=lambda: 0.2 + 0.2 * rng.random())
    t0 = time.perf_counter()
    first = run(
        multiturn.NativeTurns(engine(model)), groups(4, 4, temperature=1.0, make_env=slow), workers=16
    )
    wall = time.perf_counter() - t0
    tool_s = sum(t.tool_seconds for t in first)
    assert tool_s > 16 * 2 * 0.2 and wall < tool_s / 3, (wall, tool_s)  # 32 tool calls, not one by one
    quick = run(multiturn.NativeTurns(engine(model)), groups(4, 4, temperature=1.0), workers=1)
    assert view(first) == view(quick)


def test_turn_and_context_limits_end_trajectories(model):
    many = lambda: ReplyEnv(turns=100)
    limits = multiturn.TurnLimits(max_turns=3, max_tokens_per_turn=5, max_context=200)
    trajs = run(multiturn.NativeTurns(engine(model)), groups(make_env=many), limits)
    assert all(t.turns == 3 and t.finish_reason == "max_turns" for t in trajs)
    assert all(t.model_tokens == 15 for t in trajs)
    limits = multiturn.TurnLimits(max_turns=50, max_tokens_per_turn=6, max_context=60)
    trajs = run(multiturn.NativeTurns(engine(model)), groups(make_env=many), limits)
    assert all(t.finish_reason == "length" and len(t.prompt_ids) + len(t.token_ids) <= 60 for t in trajs)
    with pytest.raises(ValueError, match="max_context"):
        run(multiturn.NativeTurns(engine(model)), groups(), multiturn.TurnLimits(1, 4, max_context=5))


def test_tool_calls_errors_and_sandbox_timeouts_are_counted_through_real_tools():
    calc = render_tool_calls([ToolCall("calculator", {"expression": "123*45"})])
    loop = render_tool_calls([ToolCall("python", {"code": "while True:\n    pass\n"})])
    bad = calc.replace("</expression>", "</x>")
    env = ToolEnv(["calculator", "python"], max_turns=5)
    env.reset({"prompt": "123*45=", "answer": "5535"})
    for text, want in ((calc, "5535"), (bad, "error: malformed"), (loop, "error:")):
        assert text.endswith(TOOL_CALL_END)
        (replies, _, done, _), seconds = multiturn._env_step(env, text)
        assert not done and want in replies[-1]["content"]
    assert rollout.tools.sandbox.is_timeout(replies[-1]["content"]) and seconds < 10
    (_, reward, done, _), _ = multiturn._env_step(env, "Answer: 5535")
    assert done and reward == 1.0
