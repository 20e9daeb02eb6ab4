"""Faults during a GRPO run (issue: reliability): dead rollout / reward workers are restarted and
their work re-run with the same seeds (nothing lost or duplicated: the run's data and metrics equal
an uninterrupted run's); a dead learner or repeated NaN steps stop the run with a resumable
checkpoint; a SIGKILLed driver resumes with `resume=auto` to the same metrics and adapter.

Faults are real process deaths (os._exit in the actor, SIGKILL of the driver's process group),
placed deterministically by `trainer.fault_injection` (rl/faults.py) or at a random moment.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from rl.config import load_config  # noqa: E402
from rl.topology import TrainingAborted  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rollout.bases.warmup import ensure_base  # noqa: E402
from tests.reliability.drivers import rl_train  # noqa: E402

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "runs" / "_cache" / "quickstart-base"
RUN = (
    f"model.checkpoint={BASE}", "model.warmup=false", "data.num_train=256", "data.num_eval=8",
    "rollout.n_samples=4", "algo.batch_prompts=4", "algo.max_regen_rounds=1", "trainer.total_steps=3",
    "trainer.eval_every=0", "trainer.save_every=1", "trainer.micro_batch_size=16", "tracking.mode=offline",
)  # fmt: skip
IGNORED = ("timing_s/", "perf/", "sync/seconds", "sync/engine", "faults/", "_runtime", "_timestamp")


@pytest.fixture(scope="module")
def ray_local():
    ensure_base(BASE)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _fit(out: Path, *extra: str) -> dict:
    trainer = Trainer(load_config("quickstart", [f"output_dir={out}", *RUN, *extra]))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in rows]


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def baseline(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    _fit(out)
    rows = _rows(out)
    assert any(r.get("actor/pg_loss") for r in rows), "the baseline must train (reward variance)"
    return out


def _same_run(a: Path, b: Path) -> None:
    assert _rows(a) == _rows(b)
    assert (a / "samples.jsonl").read_text() == (b / "samples.jsonl").read_text()
    x, y = _adapter(a), _adapter(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("point, counter", [("rollout.generate@2", "faults/rollout_restarts"),
                                            ("reward.score@1", "faults/reward_restarts")])  # fmt: skip
def test_dead_worker_is_restarted_and_the_run_equals_an_uninterrupted_one(baseline, tmp_path, point, counter):
    out = tmp_path / "run"
    _fit(out, f"trainer.fault_injection={point}")
    assert (out / "faults" / point).exists()  # the fault really fired
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last[counter] == 1.0
    _same_run(baseline, out)


def test_dead_learner_stops_resumably_and_resume_finishes_the_same_run(baseline, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingAborted, match=r"learner died during step 2.*resume=auto"):
        _fit(out, "trainer.fault_injection=learner.train_step@1")
    _fit(out, "trainer.fault_injection=learner.train_step@1", "resume=auto")  # marker: fires once
    _same_run(baseline, out)


def test_nan_loss_skips_the_update_and_repeated_nans_abort_with_a_finite_checkpoint(ray_local, tmp_path):
    out = tmp_path / "once"
    _fit(out, "trainer.fault_injection=learner.loss@1:nan")
    by_step = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert by_step[2]["actor/nonfinite_updates"] > 0 and by_step[3]["actor/nonfinite_updates"] == 0
    assert all(torch.isfinite(t).all() for t in _adapter(out).values())
    out = tmp_path / "abort"
    with pytest.raises(TrainingAborted, match="consecutive steps had NaN/inf"):
        _fit(out, "trainer.fault_injection=learner.loss@0:nan", "trainer.max_nonfinite_steps=1")
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved, "a checkpoint is written before stopping"


def _driver(out: Path, *extra: str) -> subprocess.Popen:
    return rl_train("quickstart", out, *RUN, *extra)


def test_driver_killed_during_a_checkpoint_write_resumes_to_the_same_run(baseline, tmp_path):
    out = tmp_path / "run"
    proc = _driver(out, "trainer.fault_injection=driver.save@2")
    assert proc.wait(timeout=600) != 0
    os.killpg(proc.pid, signal.SIGKILL) if _alive(proc.pid) else None
    resumed = _driver(out, "resume=auto")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err.decode()[-2000:]
    _same_run(baseline, out)


def test_driver_sigkilled_at_a_random_moment_resumes_to_the_same_run(baseline, tmp_path):
    out = tmp_path / "run"
    rng = random.Random(int(time.time()))
    wait_rows = rng.choice([1, 2, 3])  # after step 0, 1 or 2 was logged, plus a random delay
    proc = _driver(out)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= wait_rows:
            time.sleep(rng.uniform(0, 2.0))
            break
        time.sleep(0.2)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = _driver(out, "resume=auto")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err.decode()[-2000:]
    _same_run(baseline, out)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False
