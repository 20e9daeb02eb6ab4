"""A DEP engine replica (data-parallel attention + expert-parallel MoE) on 2 gloo processes against one
single-process `NativeEngine` on the same requests (fp32 weights and caches, tiny preset, NVFP4
experts as served, routed-expert LoRA with non-zero B factors).

One launch runs every scenario (process start-up dominates on the CI's two cores): a balanced split
with requests finishing at different steps, a group of 2 samples and a seeded sampled request; a
single request (rank 1 never gets work: it runs idle EP forwards until rank 0 is done); a by-length
split; an empty request list. A watchdog in each rank turns a lockstep hang into a failed launch."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora
from model.layers.moe import MoE
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel
from model.parallel.groups import launch_local
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from rollout.native.dep import DEPEngine, run_dep_replica, split_requests
from tests.parallel.completions import assert_same, plain

HANG_S = 45.0  # a rank still running after this has deadlocked in a collective
ENGINE_KW = {"max_pages": 64, "kv_dtype": "fp32", "index_dtype": "fp32"}


def build_model() -> MiniMaxM3ForCausalLM:
    """The tiny preset (NVFP4 routed experts, fp32 everything else) with a routed-expert adapter."""
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0)
    apply_lora(model, LoRAConfig(r=4, alpha=8.0, routed_experts=True), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: the adapters change the output, sharded experts included
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _req(length: int, max_tokens: int, seed: int, n: int = 1, temperature: float = 0.0) -> Request:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (length,), generator=g).tolist()
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return Request(ids, params, n=n, seed=seed if temperature else None)


SCENARIOS = {
    # Round-robin: rank 0 gets lengths 5, 9, 12, rank 1 gets 17, 3 (and the n=2 group).
    "balanced": [_req(5, 6, 0), _req(17, 3, 1, n=2), _req(9, 8, 2), _req(3, 4, 3, temperature=1.0),
                 _req(12, 5, 4)],
    "one_request": [_req(7, 6, 5)],  # rank 1 has no request at all
    "by_length": [_req(20, 2, 6), _req(4, 9, 7), _req(6, 7, 8)],  # rank 0: the long one; rank 1: two
    "empty": [],
}  # fmt: skip
DISTRIBUTE = {"by_length": "by_length"}


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, MoE | ExpertParallelMoE)
        for t in [*m.experts.parameters(recurse=False), *m.experts.buffers(recurse=False)]
    )


def _dep_rank() -> dict:
    watchdog = threading.Timer(HANG_S, os._exit, args=(17,))  # a hung rank dies: the launch fails
    watchdog.daemon = True
    watchdog.start()
    model = build_model()
    before = _expert_bytes(model)
    apply_expert_parallel(model, None)  # None = the world: both ranks form the replica
    dep = DEPEngine(NativeEngine(model, **ENGINE_KW))
    out = {"bytes": (before, _expert_bytes(model)), "results": {}, "idle_steps": {}}
    for name, reqs in SCENARIOS.items():
        dep.distribute = DISTRIBUTE.get(name, "round_robin")
        idle0 = dep.idle_steps
        out["results"][name] = plain(dep.generate(reqs))
        out["idle_steps"][name] = dep.idle_steps - idle0
    # The one-call entry point, from a model factory (a fresh replica in the same group).
    out["replica"] = plain(run_dep_replica(build_model, SCENARIOS["balanced"], **ENGINE_KW))
    out["rank"] = dist.get_rank()
    watchdog.cancel()
    return out


@pytest.fixture(scope="module")
def runs():
    dep = launch_local(_dep_rank, 2)
    torch.set_num_threads(1)
    single = NativeEngine(build_model(), **ENGINE_KW)
    ref = {name: plain(single.generate(reqs)) for name, reqs in SCENARIOS.items()}
    return dep, ref


def test_dep_two_ranks_greedy_and_seeded_completions_equal_single_engine(runs):
    dep, ref = runs
    for name in SCENARIOS:
        for res in dep:  # every rank returns every completion, in request order
            assert_same(res["results"][name], ref[name], f"rank {res['rank']} {name}")
    assert sum(len(c[2]) for c in ref["balanced"]) == 6 + 3 * 2 + 8 + 4 + 5  # ignore_eos: full lengths
    assert dep[0]["results"]["balanced"][3][2] != ref["balanced"][0][2]  # distinct requests, not one echo


def test_dep_run_dep_replica_from_factory_equals_single_engine(runs):
    dep, ref = runs
    for res in dep:
        assert_same(res["replica"], ref["balanced"], f"replica rank {res['rank']}")


def test_dep_uneven_split_rank_without_requests_runs_idle_steps_and_completes(runs):
    dep, _ = runs
    assert dep[1]["idle_steps"]["one_request"] > 0  # rank 1 joined rank 0's every step with no tokens
    assert dep[0]["idle_steps"]["one_request"] == 0
    # Requests finish at different steps: the rank whose work ends first idles until the other ends.
    assert dep[0]["idle_steps"]["balanced"] + dep[1]["idle_steps"]["balanced"] > 0
    assert dep[0]["idle_steps"]["empty"] == dep[1]["idle_steps"]["empty"] == 0


def test_dep_each_rank_holds_half_the_routed_expert_bytes(runs):
    dep, _ = runs
    for res in dep:
        before, after = res["bytes"]
        assert before > 0 and after * 2 == before


def test_split_requests_round_robin_and_by_length_cover_every_request_once():
    reqs = SCENARIOS["balanced"]
    assert split_requests(reqs, 2) == [[0, 2, 4], [1, 3]]
    # Work (prompt tokens x samples): 5, 34, 9, 3, 12 -> 34 to rank 0, then 12, 9, 5, 3 to the lighter.
    assert split_requests(reqs, 2, "by_length") == [[1], [0, 2, 3, 4]]
    # Over 3: 34 -> r0, 12 -> r1, 9 -> r2, 5 -> r2 (9 < 12), 3 -> r1 (12 < 14).
    assert split_requests(reqs, 3, "by_length") == [[1], [3, 4], [0, 2]]
    assert split_requests([], 4) == [[], [], [], []]
    with pytest.raises(ValueError, match="distribute"):
        split_requests(reqs, 2, "random")  # type: ignore[arg-type]


def test_dep_engine_refuses_dspark_and_models_without_ep_layers():
    from rollout.dspark import Drafter, DSparkConfig

    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()
    with pytest.raises(ValueError, match="apply_expert_parallel"):
        DEPEngine(NativeEngine(model, **ENGINE_KW))
    cfg = DSparkConfig.for_target(model.config, block_size=4, num_layers=1, markov_rank=16)
    drafter = Drafter(cfg).init_weights(std=0.05, seed=1).bind(model).eval()
    with pytest.raises(ValueError, match="DSpark"):
        DEPEngine(NativeEngine(model, drafter=drafter, **ENGINE_KW))


def test_dep_engine_single_process_without_distributed_equals_plain_engine():
    reqs = SCENARIOS["by_length"]
    torch.set_num_threads(1)
    model = build_model()
    want = plain(NativeEngine(model, **ENGINE_KW).generate(reqs))
    apply_expert_parallel(model, None)  # no process group: a world of one, no collective
    got = plain(DEPEngine(NativeEngine(model, **ENGINE_KW), distribute="by_length").generate(reqs))
    assert_same(got, want, "world 1")
