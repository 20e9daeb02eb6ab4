"""Expert-parallel MoE and DEP on 1, 2 and 4 gloo processes (fp32, CPU) against the single-process MoE.

Each launch runs every check of one world size in the worker processes (process start-up dominates
on the CI's two cores) and returns tensors; the tests compare them with the single-process module
built from the same seed on the same tokens. Gradients summed over ranks equal the single-process
gradients of the union batch (the learner's data-parallel all-reduce)."""

import dataclasses

import pytest
import torch

from model.config import ModelConfig
from model.layers.lora import ExpertLoRA, LoRAConfig, apply_lora
from model.layers.moe import MoE
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.expert_parallel import (
    ExpertParallelMoE,
    apply_expert_parallel,
    expert_ranges,
    load_metrics,
)
from model.parallel.groups import ParallelGroups, launch_local

ATOL = 1e-5
NUM_EXPERTS = 6  # uneven over 4 ranks: 2, 2, 1, 1


def _moe(fmt: str, seed: int = 0) -> MoE:
    """A small MoE with random router (diverse routing), bias, experts, shared expert and expert LoRA."""
    cfg = dataclasses.replace(
        ModelConfig.preset("tiny"), hidden_size=32, moe_intermediate_size=32, shared_intermediate_size=32,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=3,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, fmt=fmt)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=gen))
        moe.e_score_correction_bias.copy_(torch.randn(NUM_EXPERTS, generator=gen) * 0.1)
        for p in moe.shared_experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        moe.experts.init_normal_(0.1, generator=gen)
        moe.experts.lora = ExpertLoRA(moe.experts, r=4, alpha=8.0, generator=gen)
        for p in moe.experts.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return moe


def _tokens(rank: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, 32], cotangent [T, 32]) of one rank: different data and sizes per rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(counts[rank], 32, generator=gen), torch.randn(counts[rank], 32, generator=gen)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _moe_step(module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _ep_worker(cases: list[tuple[str, list[int]]], with_model: bool) -> dict:
    groups = ParallelGroups.build()
    results = {}
    for fmt, counts in cases:
        moe = _moe(fmt)
        ep = ExpertParallelMoE(moe, groups.ep_group)
        lo, hi = ep.expert_lo, ep.expert_hi
        x, g = _tokens(groups.rank, counts)
        y, x_grad = _moe_step(ep, x, g)
        stats = ep.forward_with_stats(x)[1]
        results[(fmt, tuple(counts))] = {
            "y": y, "x_grad": x_grad, "grads": _grads(ep),
            "received": stats.received_per_rank_W,
            "local_experts": (ep.expert_lo, ep.expert_lo + ep.experts.num_experts),
            "shard_matches_bank": all(
                torch.equal(getattr(ep.experts, n).view(torch.uint8), t[lo:hi].view(torch.uint8))
                for n, t in moe.experts.named_buffers(recurse=False)
            ),
            "global_counts": ep.global_tokens_per_expert(stats.router.tokens_per_expert_E),
        }  # fmt: skip
    if with_model:
        results["model"] = _dep_model_step(groups)
    return results


# ------------------------------------------------------------------------------------ DEP model
def _tiny_model() -> MiniMaxM3ForCausalLM:
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(seed=0)  # NVFP4 experts
    apply_lora(model, LoRAConfig(r=4, alpha=8.0, routed_experts=True), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B factors, so every adapter tensor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _model_inputs(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randint(3, 512, (1, [11, 6, 9, 4][rank]), generator=gen)


def _model_step(model, ids: torch.Tensor):
    logits = model(ids)
    logits.logsumexp(-1).sum().backward()
    return logits.detach()


def _dep_model_step(groups: ParallelGroups) -> dict:
    model = apply_expert_parallel(_tiny_model(), groups.ep_group)
    logits = _model_step(model, _model_inputs(groups.rank))
    return {"logits": logits, "grads": _grads(model)}


# ------------------------------------------------------------------------------------ fixtures
CASES_2 = [("float", [9, 4]), ("nvfp4", [9, 4]), ("nvfp4", [5, 0])]
CASES_4 = [("nvfp4", [6, 3, 0, 8])]


@pytest.fixture(scope="module")
def world2():
    return launch_local(_ep_worker, 2, CASES_2, True)


@pytest.fixture(scope="module")
def world4():
    return launch_local(_ep_worker, 4, CASES_4, False)


def _reference(fmt: str, counts: list[int]) -> tuple[list, list, dict, torch.Tensor]:
    """Single-process MoE on each rank's tokens in turn: outputs, input grads, summed grads, counts."""
    moe = _moe(fmt)
    ys, x_grads, counts_E = [], [], torch.zeros(NUM_EXPERTS, dtype=torch.long)
    for r in range(len(counts)):
        x, g = _tokens(r, counts)
        y, x_grad = _moe_step(moe, x, g)
        ys.append(y)
        x_grads.append(x_grad)
        counts_E += moe.forward_with_stats(x)[1].tokens_per_expert_E
    return ys, x_grads, _grads(moe), counts_E


def _check_case(results: list[dict], fmt: str, counts: list[int]) -> None:
    ys, x_grads, grads, counts_E = _reference(fmt, counts)
    world = len(results)
    for r, res in enumerate(results):
        got = res[(fmt, tuple(counts))]
        assert got["y"].shape == ys[r].shape
        torch.testing.assert_close(got["y"], ys[r], atol=ATOL, rtol=0)
        torch.testing.assert_close(got["x_grad"], x_grads[r], atol=ATOL, rtol=0)
        assert torch.equal(got["global_counts"], counts_E)
    # Every rank received, in total, the slots routed to its experts by everyone.
    per_rank = torch.stack([counts_E[lo:hi].sum() for lo, hi in expert_ranges(NUM_EXPERTS, world)])
    received = torch.stack([res[(fmt, tuple(counts))]["received"].sum() for res in results])
    assert torch.equal(received, per_rank)
    assert set(grads) == set(results[0][(fmt, tuple(counts))]["grads"])  # router, shared, expert LoRA
    for name, ref in grads.items():
        total = sum(res[(fmt, tuple(counts))]["grads"][name] for res in results)
        torch.testing.assert_close(total, ref, atol=ATOL, rtol=0, msg=name)


# --------------------------------------------------------------------------------------- tests
def test_expert_ranges_are_contiguous_and_cover_every_expert_unevenly():
    assert expert_ranges(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert expert_ranges(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="world"):
        expert_ranges(2, 4)


def test_load_metrics_balanced_is_one_and_skewed_is_larger():
    even = load_metrics(torch.tensor([4, 4, 4, 4]), expert_ranges(4, 2))
    assert even["expert_max_over_mean"].item() == pytest.approx(1.0)
    skew = load_metrics(torch.tensor([8, 0, 4, 4]), expert_ranges(4, 2))
    assert skew["expert_max_over_mean"].item() == pytest.approx(2.0)
    assert skew["rank_max_over_mean"].item() == pytest.approx(1.0)
    assert torch.equal(skew["tokens_per_rank"], torch.tensor([8.0, 8.0]))


def test_ep_world1_without_distributed_equals_moe_forward_and_backward():
    moe, ref = _moe("nvfp4"), _moe("nvfp4")
    ep = ExpertParallelMoE(moe, None)
    x, g = _tokens(0, [10])
    y, x_grad = _moe_step(ep, x, g)
    y_ref, x_grad_ref = _moe_step(ref, x, g)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(x_grad, x_grad_ref, atol=ATOL, rtol=0)
    for name, want in _grads(ref).items():
        torch.testing.assert_close(_grads(ep)[name], want, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("fmt,counts", CASES_2, ids=["float", "nvfp4", "nvfp4-empty-rank"])
def test_ep_2_ranks_equals_single_process_forward_and_grads(world2, fmt, counts):
    _check_case(world2, fmt, counts)


@pytest.mark.parametrize("fmt,counts", CASES_4, ids=["nvfp4-uneven-experts-empty-rank"])
def test_ep_4_ranks_equals_single_process_forward_and_grads(world4, fmt, counts):
    _check_case(world4, fmt, counts)


def test_ep_shard_holds_only_its_experts_with_unchanged_adapter_names(world2):
    for r, res in enumerate(world2):
        got = res[("nvfp4", (9, 4))]
        assert got["local_experts"] == [(0, 3), (3, 6)][r] and got["shard_matches_bank"]
    names = set(world2[0][("nvfp4", (9, 4))]["grads"])
    assert {"experts.lora.w1.lora_A", "experts.lora.w2.lora_B", "gate.weight"} <= names


def test_dep_model_2_ranks_logits_and_lora_grads_equal_single_process(world2):
    ref = _tiny_model()
    grads_sum: dict[str, torch.Tensor] = {}
    for r, res in enumerate(world2):
        logits = _model_step(ref, _model_inputs(r))
        torch.testing.assert_close(res["model"]["logits"], logits, atol=ATOL, rtol=0)
    grads_sum = _grads(ref)  # accumulated over both ranks' sequences
    got = world2[0]["model"]["grads"]
    assert set(got) == set(grads_sum) and any(".experts.lora." in n for n in got)
    for name, want in grads_sum.items():
        total = sum(res["model"]["grads"][name] for res in world2)
        torch.testing.assert_close(total, want, atol=ATOL, rtol=0, msg=name)
