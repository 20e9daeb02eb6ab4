"""Several learners and rollout workers on Ray: data-parallel learners (gloo all-reduce of LoRA
gradients), and DEP learners (experts and expert adapters sharded, tokens exchanged by all-to-all),
take the same step as one learner on the union batch; a 2 x 2 run placed with a Ray placement group
produces the same data and metrics as a 1 x 1 run."""

from __future__ import annotations

import json
import random

import pytest
import torch

ray = pytest.importorskip("ray")

from rl.config import load_config  # noqa: E402
from rl.learner import Learner  # noqa: E402
from rl.topology import prepare_base  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rl.workers import Sample  # noqa: E402

QUICK = (
    "model.checkpoint=null", "model.warmup=false", "data.num_train=64", "data.num_eval=8",
    "rollout.n_samples=4", "rollout.max_tokens=8", "algo.batch_prompts=4", "algo.max_regen_rounds=1",
    "trainer.eval_every=1", "trainer.save_every=100", "trainer.micro_batch_size=3", "tracking.mode=offline",
    "algo.ppo_epochs=2", "algo.mini_batch_prompts=2",
)  # fmt: skip


def _samples(n_groups: int = 4, per_group: int = 4, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [1, *(rng.randrange(3, 200) for _ in range(rng.randrange(4, 9)))]
        for _ in range(per_group):
            resp = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 7))]
            out.append(Sample(uid=f"u{g}", prompt_ids=prompt, response_ids=resp,
                              rollout_logprobs=[-1.0] * len(resp), finish_reason="stop", adapter_version=0,
                              advantage=rng.uniform(-1, 1)))  # fmt: skip
    return out


def test_two_data_parallel_learners_equal_one_learner_on_the_union_batch(ray_local, tmp_path):
    cfg = load_config("quickstart", [f"output_dir={tmp_path}", *QUICK])
    base = str(prepare_base(cfg, tmp_path))
    samples = _samples()
    single = ray.remote(num_cpus=0)(Learner).remote(cfg, base)
    pair = [ray.remote(num_cpus=0)(Learner).remote(cfg, base, r, 2) for r in range(2)]
    addr = ray.get(pair[0].rendezvous_address.remote())
    ray.get([lrn.init_group.remote(*addr) for lrn in pair])
    init = ray.get(single.adapter_update.remote()).tensors
    for _ in range(2):  # two GRPO steps, each 2 epochs x 2 mini-batches (4 optimizer steps)
        m1 = ray.get(single.train_step.remote(samples))
        m2a, m2b = ray.get([lrn.train_step.remote(samples) for lrn in pair])
    one = ray.get(single.adapter_update.remote()).tensors
    a, b = (ray.get(lrn.adapter_update.remote()).tensors for lrn in pair)
    for k in one:
        assert torch.equal(a[k], b[k]), f"learners disagree on {k}"  # the same step on every learner
    # = the union batch. Not to the bit: the all-reduced gradient sums in another order, and Adam
    # turns a near-zero gradient's rounding into a sizeable step (on some CPUs 2e-4 per element
    # after 8 steps). So the DP learners' whole update must match the single learner's to 2% (a
    # missing or doubled all-reduce is off by 50-100%).
    diff = sum(float((a[k] - one[k]).pow(2).sum()) for k in one) ** 0.5
    step = sum(float((one[k] - init[k]).pow(2).sum()) for k in one) ** 0.5
    assert diff <= 0.02 * step, f"DP update differs from the union batch's by {diff / step:.1%}"
    moved = max(float(t.abs().max()) for k, t in one.items() if "lora_B" in k)
    assert moved > 1e-3  # the steps were real
    assert m2a == m2b
    # The last step's metrics are taken at the slightly different parameters above: the gradient
    # norm (a sum over near-zero entries) moves most.
    for key, rel in (("actor/pg_loss", 1e-4), ("actor/entropy", 1e-4), ("actor/grad_norm", 1e-2)):
        assert m2a[key] == pytest.approx(m1[key], rel=rel, abs=1e-6), key
    for actor in [single, *pair]:
        ray.kill(actor)


def test_two_dep_learners_with_sharded_expert_adapters_equal_one_learner(ray_local, tmp_path):
    """DEP on Ray: 2 learner actors (TCP rendezvous) each hold half the routed experts and half the
    expert adapters; after a GRPO step both return the same full adapter as one learner."""
    dep = ("trainer.learner_parallel=dep", "lora.routed_experts=true", "lora.r=4", "lora.alpha=8",
           "trainer.torch_threads=1")  # fmt: skip
    cfg = load_config("quickstart", [f"output_dir={tmp_path}", *QUICK, *dep])
    base = str(prepare_base(cfg, tmp_path))
    samples = _samples()
    single = ray.remote(num_cpus=0)(Learner).remote(cfg, base)
    pair = [ray.remote(num_cpus=0)(Learner).remote(cfg, base, r, 2) for r in range(2)]
    addr = ray.get(pair[0].rendezvous_address.remote())
    ray.get([lrn.init_group.remote(*addr) for lrn in pair])
    ray.get([single.train_step.remote(samples), *(lrn.train_step.remote(samples) for lrn in pair)])
    one = ray.get(single.adapter_update.remote()).tensors
    a, b = ray.get([lrn.adapter_update.remote() for lrn in pair])  # collective: every learner calls it
    assert any(".experts.lora." in k for k in one)
    for k in one:
        assert a.tensors[k].shape == one[k].shape, k  # the full adapter, gathered
        assert torch.equal(a.tensors[k], b.tensors[k]), f"learners disagree on {k}"
        torch.testing.assert_close(a.tensors[k], one[k], atol=2e-6, rtol=1e-4)
    for actor in [single, *pair]:
        ray.kill(actor)


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("reward/", "acc/", "response_length/", "eval/", "dynamic_sampling/")
    return [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows]


def test_two_by_two_run_in_a_placement_group_matches_one_by_one(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, extra in (("one", []), ("two", ["trainer.num_learners=2", "rollout.num_workers=2",
                                              "reward.num_workers=2", "ray.placement=pack"])):  # fmt: skip
        trainer = Trainer(load_config("quickstart", [f"output_dir={tmp_path / name}", *QUICK,
                                                     "trainer.total_steps=2", *extra]))  # fmt: skip
        try:
            trainer.fit()
        finally:
            trainer.close()
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r.get("reward/mean") for r in one] == [r.get("reward/mean") for r in two]
    assert one == two
    s1 = (tmp_path / "one" / "samples.jsonl").read_text()
    s2 = (tmp_path / "two" / "samples.jsonl").read_text()
    assert s1 == s2  # the same completions whatever the worker count


@pytest.mark.slow
def test_trainer_with_two_dep_learners_matches_one_learner(ray_local, tmp_path, monkeypatch):
    """The driver path: fingerprints (taken before sharding) agree with the engine's, the gathered
    adapter (expert factors sharded over the two learners) syncs to the engine, a checkpoint is taken
    from both learners, and the run's data and metrics equal a 1-learner run's."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = ["trainer.total_steps=2", "lora.routed_experts=true", "trainer.save_every=2"]
    for name, extra in (("one", []), ("dep", ["trainer.num_learners=2", "trainer.learner_parallel=dep"])):
        trainer = Trainer(load_config("quickstart", [f"output_dir={tmp_path / name}", *QUICK,
                                                     *common, *extra]))  # fmt: skip
        try:
            trainer.fit()
        finally:
            trainer.close()
    one, dep = _metrics(tmp_path / "one"), _metrics(tmp_path / "dep")
    assert [sorted(r) for r in one] == [sorted(r) for r in dep]
    for r1, r2 in zip(one, dep):  # expert gradients arrive through the all-to-all: summation order differs
        assert all(r2[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in r1.items()), (r1, r2)
    s1, s2 = ((tmp_path / name / "samples.jsonl").read_text() for name in ("one", "dep"))
    assert s1 == s2
    assert (tmp_path / "dep" / "adapter" / "adapter_model.safetensors").is_file()
