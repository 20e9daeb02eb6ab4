"""rl/tracking.py with the real wandb package in offline mode (no network): JSONL mirror, the binary
.wandb run file read back, online -> offline fallback, resume, reward plot."""

from __future__ import annotations

import json
import logging

import pytest

from rl.config_sections import TrackingSection
from rl.tracking import Tracker, plot_rewards, read_metrics, read_wandb_file, read_wandb_offline

pytest.importorskip("wandb")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Keep every W&B file inside tmp_path; no credentials, no network."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def _steps(history):
    return [(h["_step"], h.get("reward/mean"), h.get("acc/mean")) for h in history if "reward/mean" in h]


def test_offline_tracker_writes_jsonl_and_a_wandb_run_that_reads_back(wandb_env):
    run_dir = wandb_env / "run"
    big = "x" * 70_000  # > two 32 KiB log blocks: the run record is split FIRST / MIDDLE / LAST
    config = {"algo": {"eps_high": 0.28}, "note": big}
    tr = Tracker(TrackingSection(mode="offline", project="t"), run_dir, config)
    assert tr.mode == "offline"
    for step in range(3):
        tr.log(step, {"reward/mean": 0.25 * step, "acc/mean": 0.5 + 0.1 * step})
    tr.log(2, {"eval/acc": 0.75})
    tr.log_samples(2, [{"prompt": "1+2=", "completion": "Answer: 3", "reward": 1.0}] * 20)
    tr.update_summary({"final/acc": 0.75})
    tr.finish()

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[0] == {"step": 0, "reward/mean": 0.0, "acc/mean": 0.5}
    assert rows[-1] == {"step": 2, "eval/acc": 0.75}
    samples = [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and samples[0]["completion"] == "Answer: 3"  # capped at log_samples

    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    (run,) = read_wandb_offline(run_dir)
    assert run["run_id"] == tr.run_id and run["project"] == "t" and run["exit_code"] == 0
    assert run["config"]["algo"] == {"eps_high": 0.28} and run["config"]["note"] == big
    assert _steps(run["history"]) == [(0, 0.0, 0.5), (1, 0.25, 0.6), (2, 0.5, 0.7)]
    step2 = next(h for h in run["history"] if h["_step"] == 2)
    assert step2["eval/acc"] == 0.75 and step2["samples"]["_type"] == "table-file"
    assert step2["samples"]["nrows"] == 8
    assert run["summary"]["final/acc"] == 0.75 and run["summary"]["reward/mean"] == 0.5


def test_corrupted_wandb_file_is_reported(wandb_env):
    tr = Tracker(TrackingSection(mode="offline"), wandb_env / "run", {"a": 1})
    tr.log(0, {"reward/mean": 1.0})
    tr.finish()
    (path,) = wandb_env.glob("run/wandb/offline-run-*/run-*.wandb")
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_wandb_file(path)


def test_online_without_credentials_falls_back_to_offline_and_says_so(wandb_env, caplog):
    with caplog.at_level(logging.WARNING, logger="rl.tracking"):
        tr = Tracker(TrackingSection(mode="online"), wandb_env / "run", {})
    tr.log(0, {"reward/mean": 1.0})
    tr.finish()
    assert tr.mode == "offline"
    assert "logging offline instead" in caplog.text
    assert list(wandb_env.glob("run/wandb/offline-run-*/run-*.wandb"))


def test_online_with_unreachable_host_falls_back_to_offline(wandb_env, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # discard port: refused at once
    with caplog.at_level(logging.WARNING, logger="rl.tracking"):
        tr = Tracker(TrackingSection(mode=None), wandb_env / "run", {})  # key set -> online wanted
    tr.finish()
    assert tr.mode == "offline" and "unreachable" in caplog.text


def test_resume_continues_the_same_run_id_and_drops_lines_after_the_checkpoint(wandb_env):
    run_dir = wandb_env / "run"
    tr = Tracker(TrackingSection(mode="offline"), run_dir, {})
    for step in range(4):
        tr.log(step, {"reward/mean": float(step)})
    tr.finish()
    # crash after step 3, last checkpoint at step 1: steps 2, 3 are re-run and re-logged
    tr2 = Tracker(TrackingSection(mode="offline"), run_dir, {}, resume_run_id=tr.run_id, resume_step=1)
    for step in (2, 3):
        tr2.log(step, {"reward/mean": 10.0 + step})
    tr2.finish()
    assert tr2.run_id == tr.run_id
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(run_dir / "metrics.jsonl")] == [
        (0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0),
    ]  # fmt: skip
    first, second = read_wandb_offline(run_dir)
    assert first["run_id"] == second["run_id"] == tr.run_id
    assert [h["reward/mean"] for h in second["history"]] == [12.0, 13.0]


def test_a_resume_without_a_checkpoint_drops_what_the_killed_attempt_logged(tmp_path):
    """Killed between its first metrics row and its first checkpoint, a run resumed with resume=auto
    starts over: the rows it will re-log (a step-0 eval among them) must not stay twice."""
    from rl.resume import kept_log_step

    assert kept_log_step(None, None) is None  # no resume: append
    assert kept_log_step("auto", {"step": 4}) == 4
    first = Tracker(TrackingSection(mode="disabled"), tmp_path, {})
    first.log(0, {"eval/acc": 0.1})
    first.log(1, {"reward/mean": -1.0})
    first.finish()
    again = Tracker(TrackingSection(mode="disabled"), tmp_path, {}, resume_step=kept_log_step("auto", None))
    again.log(0, {"eval/acc": 0.1})
    again.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "eval/acc": 0.1}]


def test_disabled_tracking_writes_jsonl_only(tmp_path):
    tr = Tracker(TrackingSection(mode="disabled"), tmp_path, {})
    tr.log(0, {"reward/mean": 0.5})
    tr.log_image(0, "x", tmp_path / "none.png")  # no W&B: a no-op, not an error
    tr.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "reward/mean": 0.5}]
    assert not (tmp_path / "wandb").exists()


def test_plot_rewards_draws_a_png_from_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "reward/mean": -1 + 0.1 * s, "acc/mean": 0.05 * s} for s in range(10)]
    lines += [{"step": 0, "eval/acc": 0.1}, {"step": 9, "eval/acc": 0.4}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = plot_rewards(metrics, tmp_path / "plots" / "reward.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert not list(out.parent.glob(".*tmp*"))
    empty = plot_rewards(tmp_path / "missing.jsonl", tmp_path / "empty.png")  # before the first step
    assert empty.is_file()
