"""A decode-context-parallel (DCP) engine replica on 2 gloo processes against one single-process
`NativeEngine` on the same requests (fp32 weights and caches, tiny preset: 16-token blocks, top-2).

One launch runs every scenario (process start-up dominates on the CI's two cores): prompts of 5 to
300 tokens (up to 19 blocks, so the top-2 indexer drops most of them), chunked prefill (64-token
batches), a 2-sample group (prefix fork + copy-on-write of a table page) and a seeded sampled
request; the one-call entry point with a cache too small for its two requests (preemption by
recomputation); NVFP4 K/V and index caches; a one-prompt prefill whose pages are compared with the
single engine's; and a forced rank disagreement, which the agreement check must catch. A watchdog
in each rank turns a hang in a collective into a failed launch."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.groups import launch_local
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from rollout.native.dcp import DCPEngine, run_dcp_replica
from tests.parallel.completions import assert_same, plain

HANG_S = 45.0  # a rank still running after this has deadlocked in a collective
ENGINE_KW = {"kv_dtype": "fp32", "index_dtype": "fp32", "max_batch_tokens": 64}
SINGLE_PAGES = 96  # pages of 16 tokens
DCP_PAGES = 32  # local pages per rank = table pages of 32 tokens


def build_model() -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()


def _req(length: int, max_tokens: int, seed: int, n: int = 1, temperature: float = 0.0) -> Request:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (length,), generator=g).tolist()
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return Request(ids, params, n=n, seed=seed if temperature else None)


REQUESTS = [_req(300, 6, 0), _req(150, 5, 1), _req(37, 7, 2), _req(5, 4, 3), _req(100, 5, 4, n=2),
            _req(90, 6, 5, temperature=1.0)]  # fmt: skip
REPLICA_REQUESTS = [_req(60, 40, 6), _req(60, 30, 12)]  # both running outgrow REPLICA_PAGES
REPLICA_PAGES = 5
NVFP4_REQUESTS = [_req(120, 4, 10), _req(33, 3, 11)]
NVFP4_KW = {"kv_dtype": "nvfp4", "index_dtype": "nvfp4", "max_batch_tokens": 64}
PREFILL = _req(125, 3, 7)  # 8 blocks: 4 per rank
PREFILL_KW = {"kv_dtype": "fp32", "index_dtype": "fp32", "max_batch_tokens": 128}


def _prefill_state(engine: NativeEngine) -> dict:
    """After one step of PREFILL alone: KV bytes held, and this rank's layer-0 K/V and layer-1 index
    keys of the sequence with their global positions."""
    engine.add_request(PREFILL)
    engine.step()
    seq = engine.scheduler.running[0]
    table_P = torch.tensor(seq.block_table)
    n = torch.tensor([seq.num_computed])
    cache = engine.cache
    layout = getattr(cache, "layout", None)
    local = int(layout.local_seq_lens(n)) if layout else int(n)
    positions = layout.key_positions(local, "cpu") if layout else torch.arange(local)
    k, v = cache.gather(0, table_P, local)
    page_bytes = cache.total_bytes_per_token() * cache.page_size
    index = cache.gather_index(1, table_P, local)
    out = {"bytes": engine.scheduler.allocator.num_in_use * page_bytes, "k": k, "v": v, "index": index,
           "positions": positions}  # fmt: skip
    if isinstance(engine, DCPEngine):
        out["bytes_method"] = engine.kv_bytes_in_use()
    while engine.has_unfinished():
        engine.step()
    return out


def _dcp_rank() -> dict:
    watchdog = threading.Timer(HANG_S, os._exit, args=(17,))  # a hung rank dies: the launch fails
    watchdog.daemon = True
    watchdog.start()
    model = build_model()
    dcp = DCPEngine(model, DCP_PAGES, check_every=1, **ENGINE_KW)
    done = dcp.generate(REQUESTS)
    stats = dcp.stats()
    out = {"rank": dist.get_rank(), "results": plain(done), "steps": stats.steps}
    out["shared_pages"] = stats.shared_prefix_pages
    out["checks"] = dcp.num_checks
    out["prefill"] = _prefill_state(DCPEngine(model, 8, **PREFILL_KW))
    out["nvfp4"] = plain(DCPEngine(model, 8, **NVFP4_KW).generate(NVFP4_REQUESTS))
    replica = run_dcp_replica(build_model, REPLICA_REQUESTS, max_pages=REPLICA_PAGES, **ENGINE_KW)
    out["replica"] = plain(replica)
    out["replica_preemptions"] = sum(c.num_preemptions for c in replica)
    try:  # rank 1 claims a completion rank 0 does not have: both must raise, none may hang
        dcp.check_agreement(done[:1] if out["rank"] == 1 else [])
        out["diverged"] = None
    except RuntimeError as e:
        out["diverged"] = str(e)
    watchdog.cancel()
    return out


@pytest.fixture(scope="module")
def runs():
    dcp = launch_local(_dcp_rank, 2)
    torch.set_num_threads(1)
    model = build_model()
    single = NativeEngine(model, SINGLE_PAGES, **ENGINE_KW)
    ref = {"results": plain(single.generate(REQUESTS)), "replica": plain(single.generate(REPLICA_REQUESTS))}
    ref["prefill"] = _prefill_state(NativeEngine(model, 16, **PREFILL_KW))
    ref["nvfp4"] = plain(NativeEngine(model, 16, **NVFP4_KW).generate(NVFP4_REQUESTS))
    return dcp, ref


def test_dcp_two_ranks_greedy_and_seeded_completions_equal_single_engine(runs):
    dcp, ref = runs
    cfg = ModelConfig.preset("tiny")
    longest_blocks = -(-max(len(r.prompt_token_ids) for r in REQUESTS) // cfg.index_block_size)
    assert longest_blocks > 4 * cfg.index_topk_blocks  # the indexer drops blocks: selection matters
    for res in dcp:  # every rank returns every completion, in request order
        assert_same(res["results"], ref["results"], f"rank {res['rank']}")
        assert_same(res["replica"], ref["replica"], f"run_dcp_replica rank {res['rank']}")
        assert res["checks"] == res["steps"] + 1  # agreement checked after every step and at the end
        assert res["shared_pages"] == 3  # the 2-sample group forked: 3 full 32-token table pages shared
        assert res["replica_preemptions"] > 0  # same decisions on both ranks, preemption included
    assert sum(len(c[2]) for c in ref["results"]) == 6 + 5 + 7 + 4 + 5 * 2 + 6  # ignore_eos: full lengths


def test_dcp_two_ranks_nvfp4_cache_completions_equal_single_engine(runs):
    dcp, ref = runs
    for res in dcp:
        assert_same(res["nvfp4"], ref["nvfp4"], f"nvfp4 rank {res['rank']}")


def test_dcp_each_rank_holds_half_the_kv_pages_and_exactly_its_blocks(runs):
    dcp, ref = runs
    want = ref["prefill"]
    held = []
    for res in dcp:
        got = res["prefill"]
        assert got["bytes"] * 2 == want["bytes"] and got["bytes_method"] == got["bytes"]
        blocks = set((got["positions"] // 16).tolist())
        assert blocks == set(range(res["rank"], 8, 2))  # block b on rank b % 2
        held += got["positions"].tolist()
        p = got["positions"]
        torch.testing.assert_close(got["k"], want["k"][p], atol=0, rtol=0)  # layer 0: same inputs
        torch.testing.assert_close(got["v"], want["v"][p], atol=0, rtol=0)
        torch.testing.assert_close(got["index"], want["index"][p], atol=1e-5, rtol=0)
    assert sorted(held) == list(range(len(PREFILL.prompt_token_ids)))  # together: every key once


def test_dcp_agreement_check_raises_on_every_rank_when_ranks_diverge(runs):
    dcp, _ = runs
    for res in dcp:
        assert res["diverged"] is not None and "diverged" in res["diverged"]


def test_dcp_engine_single_process_equals_plain_engine():
    torch.set_num_threads(1)
    model = build_model()
    reqs = [_req(70, 4, 8), _req(40, 3, 9, n=2)]
    want = plain(NativeEngine(model, 32, **ENGINE_KW).generate(reqs))
    dcp = DCPEngine(model, 32, check_every=1, **ENGINE_KW)  # no process group: a world of one
    assert dcp.cache.table_page_size == dcp.cache.page_size
    assert_same(plain(dcp.generate(reqs)), want, "world 1")


def test_dcp_engine_refuses_dspark_and_a_prebuilt_cache_with_dtypes():
    from rollout.dspark import Drafter, DSparkConfig

    model = build_model()
    cfg = DSparkConfig.for_target(model.config, block_size=4, num_layers=1, markov_rank=16)
    drafter = Drafter(cfg).init_weights(std=0.05, seed=1).bind(model).eval()
    with pytest.raises(ValueError, match="DSpark"):
        DCPEngine(model, 8, drafter=drafter)
    with pytest.raises(ValueError, match="prebuilt cache"):
        NativeEngine(model, 8, kv_dtype="fp32", cache=model.new_kv_cache(8))
