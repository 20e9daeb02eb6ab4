"""DEP learners (data-parallel attention + expert-parallel MoE, expert adapters sharded) on 2 gloo
processes against one learner on the union batch (fp32, CPU, tiny preset).

One launch runs everything the two ranks do (process start-up and model building dominate on the
CI's two cores): a GRPO update whose mini-batches give the ranks different micro-batch counts (the
padding path), the gathered adapter, gradients and optimizer state, then a fresh pair of learners
resuming from the gathered checkpoint and taking a second update. The reference is a single
`Learner` doing the same in this process."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from model.config import ModelConfig
from model.layers.lora import ExpertLoRA, OffsetExpertLoRA
from model.layers.moe import MoE
from model.parallel.dep_learner import (
    ExpertShard,
    gather_expert_shards,
    gather_optimizer_state,
    slice_expert_shards,
    slice_optimizer_state,
)
from model.parallel.expert_parallel import ExpertParallelMoE
from model.parallel.groups import launch_local
from rl.config import load_config
from rl.learner import Learner
from rl.topology import prepare_base
from rl.workers import Sample

SCALED_TOL = 1e-5  # of the reference tensor's largest magnitude (gradients here are ~1e-4, moments ~1e-9)
# Adapters after Adam steps: elements whose gradient is at float-noise level move by a noise-level
# fraction of lr (1e-3) in either run, so compare them as the data-parallel learner tests do.
ADAPTER_ATOL = 2e-6
OVERRIDES = (
    "model.checkpoint=null", "model.warmup=false", "lora.routed_experts=true", "lora.r=4", "lora.alpha=8",
    "trainer.micro_batch_size=2", "trainer.learner_parallel=dep", "algo.ppo_epochs=1",
    "algo.mini_batch_prompts=2", "trainer.torch_threads=1", "optim.warmup_steps=0", "optim.grad_clip=0.001",
    "tracking.mode=offline",
)  # fmt: skip


def _samples(seed: int) -> list[Sample]:
    """3 prompts x 5 samples: mini-batches of 10 and 5 samples, so with micro-batches of 2 the
    second gives the ranks 3 and 2 samples, i.e. 2 and 1 micro-batches (rank 1 gets padded)."""
    rng = random.Random(seed)
    out = []
    for g in range(3):
        prompt = [1, *(rng.randrange(3, 200) for _ in range(rng.randrange(4, 9)))]
        for _ in range(5):
            resp = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 7))]
            out.append(Sample(uid=f"u{g}", prompt_ids=prompt, response_ids=resp,
                              rollout_logprobs=[-1.0] * len(resp), finish_reason="stop", adapter_version=0,
                              advantage=rng.uniform(-1, 1)))  # fmt: skip
    return out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(routed-expert storage bytes, routed-expert adapter bytes) this process holds."""
    store = adapters = 0
    for m in model.modules():
        if isinstance(m, MoE | ExpertParallelMoE):
            bank = m.experts
            store += _bytes([*bank.parameters(recurse=False), *bank.buffers(recurse=False)])
            if isinstance(bank.lora, ExpertLoRA | OffsetExpertLoRA):
                adapters += _bytes(bank.lora.parameters())
    return store, adapters


def _grads(lrn: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}


def _starved_moe() -> MoE:
    """A float MoE (4 experts, top-2) whose router bias sends every token to experts 0 and 1, with
    a non-zero expert LoRA: over 2 ranks, rank 1 receives no rows at all."""
    cfg = dataclasses.replace(
        ModelConfig.preset("tiny"), hidden_size=16, moe_intermediate_size=16, shared_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    moe = MoE(cfg, fmt="float")
    with torch.no_grad():
        for p in (moe.gate.weight, *moe.shared_experts.parameters()):  # nothing from the global RNG
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
        moe.experts.init_normal_(0.1, generator=gen)
        moe.experts.lora = ExpertLoRA(moe.experts, r=2, alpha=4.0, generator=gen)
        for p in moe.experts.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    moe.requires_grad_(False)
    moe.experts.lora.requires_grad_(True)
    return moe


def _starved_step(module: torch.nn.Module, rank: int, x_requires_grad: bool) -> dict[str, torch.Tensor]:
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_(x_requires_grad)
    module(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _starved_rank(rank: int) -> list[dict]:
    """Backward of an EP layer on a rank that received no rows: with only the adapter trainable and
    with input gradients too. Must not deadlock (the backward all-to-alls still run here)."""
    out = []
    for x_requires_grad in (False, True):
        ep = ExpertParallelMoE(_starved_moe(), None, shard_lora=True)
        out.append(_starved_step(ep, rank, x_requires_grad))
    return out


def _dep_rank(cfg, base: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    starved = _starved_rank(rank)
    lrn = Learner(cfg, base, rank, world)
    before = _expert_bytes(lrn.model)
    lrn.init_group()
    out = {"bytes_before": before, "bytes_after": _expert_bytes(lrn.model), "fingerprint": lrn.fingerprint()}
    out["ranges"] = {n: (s.lo, s.hi) for n, s in lrn.shards.items()}
    out["param_names"] = [n for n, p in lrn.model.named_parameters() if p.requires_grad]
    out["metrics"] = lrn.train_step(_samples(0))
    out["grads"] = _grads(lrn)  # the last mini-batch's (clipped) gradients
    out["state"] = copy.deepcopy(lrn.state_dict())  # collective: the single-process layout everywhere
    out["update1"] = lrn.adapter_update().tensors
    resumed = Learner(cfg, base, rank, world)
    resumed.init_group()
    resumed.load_state_dict(copy.deepcopy(out["state"]))  # torch shares scalar `step` tensors on load
    resumed.train_step(_samples(1))
    out["update2"] = resumed.adapter_update().tensors
    out["starved"] = starved
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dep")
    cfg = load_config("quickstart", [f"output_dir={tmp}", *OVERRIDES])
    base = str(prepare_base(cfg, tmp))
    dep = launch_local(_dep_rank, 2, cfg, base)
    single = Learner(cfg, base)
    ref = {"bytes": _expert_bytes(single.model), "fingerprint": single.fingerprint()}
    ref["metrics"] = single.train_step(_samples(0))
    ref["grads"] = _grads(single)
    ref["state"] = copy.deepcopy(single.state_dict())  # a snapshot: the next step updates in place
    ref["update1"] = single.adapter_update().tensors
    ref["param_names"] = [n for n, p in single.model.named_parameters() if p.requires_grad]
    single.train_step(_samples(1))
    ref["update2"] = single.adapter_update().tensors
    return dep, ref


def _close(got: torch.Tensor, want: torch.Tensor, msg: str, atol: float | None = None) -> None:
    """Equal up to fp32 summation order: shapes exact, values within SCALED_TOL of want's scale."""
    assert got.shape == want.shape, msg
    atol = SCALED_TOL * float(want.abs().max()) + 1e-30 if atol is None else atol
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4, msg=msg)


def _assert_adapters_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, t in want.items():
        _close(got[k], t, k, ADAPTER_ATOL)


# --------------------------------------------------------------------------------------- tests
def test_dep_two_learners_adapter_after_a_step_equals_one_learner_on_the_union_batch(runs):
    dep, ref = runs
    _assert_adapters_equal(dep[0]["update1"], ref["update1"])
    for k, t in dep[0]["update1"].items():
        assert torch.equal(t, dep[1]["update1"][k]), f"learners disagree on {k}"
    moved = max(
        float(t.abs().max()) for k, t in ref["update1"].items() if ".experts.lora." in k and "lora_B" in k
    )
    assert moved > 1e-4  # the expert adapters really trained
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert dep[0]["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    assert ref["metrics"]["actor/grad_norm"] > 0.001  # clipping was active: the global norm mattered


def test_dep_expert_lora_grads_are_the_union_batch_rows_and_replicated_grads_match(runs):
    dep, ref = runs
    assert dep[0]["param_names"] == ref["param_names"]  # same names and order: optimizer layout
    for r, res in enumerate(dep):
        assert set(res["grads"]) == set(ref["grads"])
        for name, want in ref["grads"].items():
            if name in res["ranges"]:
                lo, hi = res["ranges"][name]
                assert (lo, hi) == [(0, 4), (4, 8)][r]
                want = want[lo:hi]
            _close(res["grads"][name], want, f"rank {r} {name}")


def test_dep_each_learner_loads_and_keeps_only_half_the_routed_experts_and_their_adapters(runs):
    dep, ref = runs
    store_ref, lora_ref = ref["bytes"]
    assert store_ref > 0 and lora_ref > 0
    for res in dep:
        (store0, lora0), (store1, lora1) = res["bytes_before"], res["bytes_after"]
        # Built from the checkpoint with its expert range: the other half was never allocated; the
        # whole-layer adapter it starts from is cut to its experts' factors by init_group.
        assert store0 * 2 == store_ref and lora0 == lora_ref
        assert store1 * 2 == store_ref and lora1 * 2 == lora_ref
    # Each learner gathers the other's expert digests: both hash to the whole base's fingerprint.
    assert dep[0]["fingerprint"] == dep[1]["fingerprint"] == ref["fingerprint"]


def test_dep_checkpoint_is_the_single_process_state_and_resumes_to_the_same_adapter(runs):
    dep, ref = runs
    _assert_adapters_equal(dep[0]["state"]["adapter"], ref["state"]["adapter"])
    got, want = dep[0]["state"]["optimizer"]["state"], ref["state"]["optimizer"]["state"]
    assert sorted(got) == sorted(want)
    for idx, st in want.items():
        for k, t in st.items():
            _close(got[idx][k], t, f"{idx}.{k}")
    _assert_adapters_equal(dep[0]["update2"], ref["update2"])
    _assert_adapters_equal(dep[1]["update2"], ref["update2"])


def test_ep_rank_receiving_no_rows_still_joins_the_backward_and_grads_match(runs):
    dep, _ = runs
    for case, x_requires_grad in enumerate((False, True)):
        ref = _starved_moe()
        for r in range(2):  # the union batch: both ranks' tokens through one MoE
            _starved_step(ref, r, x_requires_grad)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert set(ref_grads) == set(dep[0]["starved"][case]) == set(dep[1]["starved"][case])
        for name, want in ref_grads.items():
            got0, got1 = dep[0]["starved"][case][name], dep[1]["starved"][case][name]
            _close(got0, want[:2], f"rank 0 {name}")
            assert torch.equal(got1, torch.zeros_like(want[2:])), name  # no tokens reached experts 2, 3


def test_expert_shard_gather_and_slice_are_identities_on_one_process():
    shard = ExpertShard(0, 3, 3, ((0, 3),), None)
    tensors = {"a.experts.lora.w1.lora_A": torch.randn(3, 2, 4), "q.lora_A.weight": torch.randn(2, 4)}
    shards = {"a.experts.lora.w1.lora_A": shard}
    full = gather_expert_shards(tensors, shards)
    assert all(torch.equal(full[k], tensors[k]) for k in tensors)
    assert all(torch.equal(slice_expert_shards(full, shards)[k], tensors[k]) for k in tensors)
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 2, 4)}}, "param_groups": []}
    back = slice_optimizer_state(gather_optimizer_state(state, {0: shard}), {0: shard})
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_slicing_a_state_with_another_expert_count_names_the_layout():
    shard = ExpertShard(2, 4, 4, ((0, 2), (2, 4)), None)
    with pytest.raises(ValueError, match="expected 4 expert rows"):
        slice_expert_shards(
            {"x.experts.lora.w2.lora_B": torch.zeros(8, 3, 2)}, {"x.experts.lora.w2.lora_B": shard}
        )


def test_learner_parallel_dep_is_validated(tmp_path):
    with pytest.raises(ValueError, match="learner_parallel"):
        load_config("quickstart", [f"output_dir={tmp_path}", "trainer.learner_parallel=tp"])
    cfg = load_config("quickstart", [f"output_dir={tmp_path}", "trainer.learner_parallel=dep"])
    assert cfg.trainer.learner_parallel == "dep"
    # With expert adapters the driver asks every learner (their adapter / state calls are collective).
    cfg = load_config("quickstart", [f"output_dir={tmp_path}", "trainer.learner_parallel=dep",
                                     "lora.routed_experts=true", "trainer.num_learners=2"])  # fmt: skip
    assert cfg.lora.routed_experts and cfg.trainer.num_learners == 2
