"""Multi-turn runs under faults (real Ray, real sandbox processes, real process deaths): a model that
calls `python` with hostile programs (an endless loop, a 1 GB allocation, a socket connect, a write
outside its scratch directory, huge output) keeps the trainer running, the failures counted; a
SIGKILLed driver resumes a multi-turn run with `resume=auto` to the same metrics, samples and adapter.

The base is a tools warm-up (rollout/bases/tools_warmup.py) whose examples all call `python` with
those programs, built once and cached in runs/_cache/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from rl.config import load_config  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rollout.bases.tools_warmup import build_tools_base  # noqa: E402
from rollout.bases.warmup import cached_base  # noqa: E402
from tests.reliability.drivers import rl_train  # noqa: E402

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "runs" / "_cache" / "tools-test-base"
HOSTILE = (
    "while True:\n    pass\n",
    "x = bytearray(1 << 30)\nprint(len(x))\n",
    "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n",
    "open('/etc/sandbox-escape', 'w').write('x')\n",
    "print('x' * 100000)\n",
)
RUN = (
    f"model.checkpoint={BASE}", "model.warmup=false", "data.num_train=64", "data.num_eval=4",
    "rollout.n_samples=4", "algo.batch_prompts=2", "algo.max_regen_rounds=0", "trainer.total_steps=3",
    "trainer.eval_every=0", "trainer.save_every=1", "trainer.micro_batch_size=8", "tracking.mode=offline",
    "rollout.multi_turn.tools=[calculator,python]", "rollout.multi_turn.python_cpu_s=1",
    "rollout.multi_turn.python_wall_s=2", "rollout.multi_turn.max_turns=2",
    # A `python` call of the longest hostile program is ~240 bytes: turns of 192 tokens would cut it.
    "rollout.max_tokens=320", "rollout.multi_turn.max_context=1024",
    # No program prints the answer, so every reward is -1: keep the groups (zero advantages) so the
    # learner still steps on these trajectories and samples.jsonl shows them.
    "algo.dynamic_sampling=false",
)  # fmt: skip
IGNORED = ("timing_s/", "perf/", "sync/seconds", "sync/engine", "faults/", "multi_turn/tool_seconds",
           "_runtime", "_timestamp")  # fmt: skip


@pytest.fixture(scope="module")
def ray_local():
    if not cached_base(BASE, {"tool_share": 1.0, "mix_steps": 0, "copy_weight": 8.0}):
        # Every example a `python` call of one of the programs: 150 steps of a calculator / python mix
        # left sampled calls malformed (tags never closed), so no program reached the sandbox.
        build_tools_base(BASE, tool_share=1.0, python_share=1.0, max_steps=200, mix_steps=0,
                         eval_every=10**9, num_eval=8, python_codes=HOSTILE)  # fmt: skip
    from tests.conftest import start_local_ray

    start_local_ray(ray)
    yield ray
    ray.shutdown()


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in rows]


@pytest.fixture(scope="module")
def baseline(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    trainer = Trainer(load_config("quickstart_tools", [f"output_dir={out}", *RUN]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return out


def test_hostile_sandboxed_code_is_counted_and_the_run_keeps_training(baseline):
    rows = _rows(baseline)
    assert [r["step"] for r in rows] == [1, 2, 3]
    calls = sum(r["multi_turn/tool_calls"] for r in rows)
    assert calls > 0, "the test base must call tools"
    assert sum(r["multi_turn/sandbox_timeouts"] for r in rows) > 0
    assert sum(r["multi_turn/tool_errors"] for r in rows) > 0
    assert not any(r.get("actor/skipped_step") for r in rows), "the learner must step on every batch"
    assert all(r["actor/grad_norm"] == r["actor/grad_norm"] for r in rows)  # finite: the update ran
    samples = (baseline / "samples.jsonl").read_text()
    assert "<tool_response>" in samples and "error:" in samples  # whole trajectories, tool replies in them
    assert not Path("/etc/sandbox-escape").exists()


def _driver(out: Path, *extra: str) -> subprocess.Popen:
    return rl_train("quickstart_tools", out, *RUN, *extra)


def test_sigkilled_driver_resumes_a_multiturn_run_to_the_same_run(baseline, tmp_path):
    out = tmp_path / "run"
    proc = _driver(out)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:
            time.sleep(1.0)  # inside step 2's rollouts
            break
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = _driver(out, "resume=auto")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert _rows(out) == _rows(baseline)
    assert (out / "samples.jsonl").read_text() == (baseline / "samples.jsonl").read_text()
    a = load_file(baseline / "adapter" / "adapter_model.safetensors")
    b = load_file(out / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
