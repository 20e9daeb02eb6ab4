"""DEP engine replicas in the Ray trainer (`rollout.engine_parallel=dep`, rl/replicas.py): two rank
actors (gloo, tiny preset, NVFP4 routed experts) serve as one rollout worker and return the samples
one unsharded engine returns; a whole run through `Trainer` equals an `engine_parallel=none` run;
bad configurations are refused with the key and the fix."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from common.data import Prompt  # noqa: E402
from model.layers.moe import MoE  # noqa: E402
from model.parallel.expert_parallel import ExpertParallelMoE  # noqa: E402
from rl.config import load_config  # noqa: E402
from rl.replicas import RolloutRank, RolloutReplica, fetch  # noqa: E402
from rl.sync import make_update  # noqa: E402
from rl.topology import prepare_base  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rl.workers import RolloutWorker, adapter_tensors  # noqa: E402

QUICK = (
    "model.checkpoint=null", "model.warmup=false", "data.num_train=64", "data.num_eval=8",
    "rollout.n_samples=4", "rollout.max_tokens=8", "algo.batch_prompts=4", "algo.max_regen_rounds=1",
    "trainer.eval_every=1", "trainer.save_every=100", "trainer.micro_batch_size=8", "tracking.mode=offline",
    "lora.routed_experts=true", "lora.r=4", "lora.alpha=8", "rollout.torch_threads=1",
)  # fmt: skip
DEP = ("rollout.engine_parallel=dep", "rollout.engine_ranks=2")


# ------------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.engine_ranks=2"], "rollout.engine_ranks=2 needs rollout.engine_parallel=dep"),
        (["rollout.engine_parallel=dep"], "needs rollout.engine_ranks >= 2"),
        (["rollout.engine_parallel=dep", "rollout.engine_ranks=0"], "rollout.engine_ranks must be >= 1"),
        ([*DEP, "rollout.backend=vllm"], "set rollout.backend=native"),
        ([*DEP, "rollout.dspark.drafter=/tmp/drafter"], "set rollout.dspark.drafter=null"),
        (["rollout.engine_parallel=dep", "rollout.engine_ranks=3"], "8 routed experts, not divisible"),
        ([*DEP, "model.family=hf", "model.checkpoint=/tmp/x", "rollout.backend=native"], "model.family=hf"),
    ],
)
def test_dep_engine_config_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config("quickstart", ["model.checkpoint=null", *overrides])


def test_dep_engine_config_accepts_a_divisor_of_the_expert_count():
    cfg = load_config(
        "quickstart", ["model.checkpoint=null", "rollout.engine_parallel=dep", "rollout.engine_ranks=4"]
    )
    assert (cfg.rollout.engine_parallel, cfg.rollout.engine_ranks) == ("dep", 4)
    assert load_config("quickstart", ["model.checkpoint=null"]).rollout.engine_ranks == 1


# ------------------------------------------------------------------------------------ replica on Ray
def test_two_rank_dep_replica_returns_the_single_engine_samples(ray_local, tmp_path):
    """Seeded sampling (temperature 1) with a non-zero adapter on every expert: the replica (each rank
    holding half the experts, requests split over the ranks) gives the same samples as one engine."""

    def expert_rows(worker) -> int:  # routed experts stored by one process (pickled by value to actors)
        return sum(
            m.experts.w1_weight.shape[0]
            for m in worker.model.modules()
            if isinstance(m, MoE | ExpertParallelMoE)
        )

    cfg = load_config("quickstart", [f"output_dir={tmp_path}", *QUICK, *DEP])
    base = str(prepare_base(cfg, tmp_path))
    single = RolloutWorker(load_config("quickstart", [f"output_dir={tmp_path}", *QUICK]), base)
    replica = RolloutReplica(lambda r: ray.remote(num_cpus=0)(RolloutRank).remote(cfg, base, 0, r, 2), 2)
    try:
        replica.form_group()
        gen = torch.Generator().manual_seed(0)
        tensors = {k: (torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v)
                   for k, v in adapter_tensors(single.model).items()}  # fmt: skip
        assert any(".experts." in k for k in tensors)
        update = make_update(tensors, 1)
        single.set_adapter(update)
        fetch(replica.set_adapter.remote(update))
        assert fetch(replica.fingerprint.remote()) == single.fingerprint()  # the unsharded base's
        prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"{i} + {2 * i} ="}], str(3 * i), "t")
                   for i in range(5)]  # fmt: skip
        args = (prompts, 2, 1.0, 1.0, 11, 1)
        want = single.generate(*args)
        got = fetch(replica.generate.remote(*args))
        per_rank = ray.get([a.__ray_call__.remote(expert_rows) for a in replica.ranks])
    finally:
        replica.kill()
    assert per_rank == [expert_rows(single) // 2] * 2  # each rank holds half the routed experts
    assert [(s.uid, s.response_ids, s.finish_reason, s.adapter_version) for s in got] == [
        (s.uid, s.response_ids, s.finish_reason, s.adapter_version) for s in want
    ]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)
    assert len({tuple(s.response_ids) for s in got}) > 1  # sampled, not degenerate


# ------------------------------------------------------------------------------------ trainer runs
def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skip = ("timing_s/", "perf/", "sync/seconds", "sync/engine", "faults/", "_runtime", "_timestamp")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


def _fit(out, *extra: str) -> None:
    trainer = Trainer(
        load_config("quickstart", [f"output_dir={out}", *QUICK, "trainer.total_steps=2", *extra])
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


def _same_run(one, dep) -> None:
    """Same completions, metrics (engine log-probs: EP sums experts in another order) and adapter."""
    m1, m2 = _metrics(one), _metrics(dep)
    assert [sorted(r) for r in m1] == [sorted(r) for r in m2]
    for r1, r2 in zip(m1, m2, strict=True):
        assert all(r2[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in r1.items()), (r1, r2)
    assert (one / "samples.jsonl").read_text() == (dep / "samples.jsonl").read_text()
    a, b = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (one, dep))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_trainer_with_dep_engine_replica_matches_a_single_process_engine(ray_local, tmp_path, monkeypatch):
    """Two GRPO steps with eval through `Trainer`: one replica of 2 DEP ranks in a placement group
    (a bundle per rank, then the learner's) gives the samples, metrics and adapter of a 1-process
    engine."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit(tmp_path / "one")
    _fit(tmp_path / "dep", *DEP, "ray.placement=pack")
    _same_run(tmp_path / "one", tmp_path / "dep")


@pytest.mark.reliability
def test_dead_dep_rank_restarts_the_replica_and_the_run_is_unchanged(ray_local, tmp_path, monkeypatch):
    """One rank of the replica dies (os._exit) in step 1's rollout: the replica is killed and
    restarted, its group re-formed, the adapter re-sent and the rollout re-run with the same seeds."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit(tmp_path / "one")
    _fit(tmp_path / "dep", *DEP, "trainer.fault_injection=rollout.generate@1")
    _same_run(tmp_path / "one", tmp_path / "dep")
    rows = [json.loads(line) for line in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["faults/rollout_restarts"] == 1.0
