"""DCP engine replicas in the Ray trainer (`rollout.engine_parallel=dcp`, rl/replicas.py): two rank
actors (gloo, tiny preset: 16-token blocks, top-2 indexer) each hold the whole model and half of every
sequence's KV / index-key pages, serve as one rollout worker and return the samples one engine returns,
with `rollout.max_pages` counted per rank; a whole run through `Trainer` equals an `engine_parallel=none`
run; bad configurations are refused with the key and the fix."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from common.data import Prompt  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from rl.config import load_config  # noqa: E402
from rl.replicas import RolloutRank, RolloutReplica, fetch, replica_size  # noqa: E402
from rl.sync import make_update  # noqa: E402
from rl.topology import prepare_base  # noqa: E402
from rl.workers import RolloutWorker, adapter_tensors  # noqa: E402
from tests.rl.test_dep_rollout import QUICK, _fit, _same_run  # noqa: E402

DCP = ("rollout.engine_parallel=dcp", "rollout.engine_ranks=2")
DCP_PAGES = 16  # local pages per rank: 256 tokens of one engine, 512 of the 2-rank replica
TINY = ModelConfig.preset("tiny")


# ------------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.engine_parallel=dcp"], "rollout.engine_parallel=dcp needs rollout.engine_ranks >= 2"),
        ([*DCP, "rollout.backend=vllm"], "set rollout.backend=native"),
        ([*DCP, "rollout.dspark.drafter=/tmp/drafter"], "set rollout.dspark.drafter=null"),
        ([*DCP, "model.family=hf", "model.checkpoint=/tmp/x", "rollout.backend=native"], "model.family=hf"),
        ([*DCP, "model.overrides.layer_types=[full_attention,full_attention,full_attention,full_attention]"],
         "has no sparse attention layer"),
        ([*DCP, "model.preset=tiny-vl"], "model.preset=tiny-vl has a vision tower"),
        (["rollout.engine_parallel=dcp", "rollout.engine_ranks=0"], "rollout.engine_ranks must be >= 1"),
    ],
)  # fmt: skip
def test_dcp_engine_config_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config("quickstart", ["model.checkpoint=null", *overrides])


def test_dcp_engine_config_accepts_any_rank_count_and_sizes_the_replica():
    """Unlike dep (ranks must divide the expert count), dcp interleaves pages: 3 ranks are fine."""
    cfg = load_config(
        "quickstart", ["model.checkpoint=null", "rollout.engine_parallel=dcp", "rollout.engine_ranks=3"]
    )
    assert (cfg.rollout.engine_parallel, cfg.rollout.engine_ranks, replica_size(cfg)) == ("dcp", 3, 3)
    with pytest.raises(ValueError, match=r"not divisible by rollout\.engine_ranks=3"):
        load_config(
            "quickstart", ["model.checkpoint=null", "rollout.engine_parallel=dep", "rollout.engine_ranks=3"]
        )


# ------------------------------------------------------------------------------------ replica on Ray
def _long_prompt(i: int) -> Prompt:
    """A sum of 38 + 25 i one-digit terms: 150 to 350 byte tokens for i < 3, 10 to 22 blocks of 16 (the
    indexer keeps 2 per query)."""
    terms = " + ".join(str(7 * j % 10) for j in range(38 + 25 * i))
    return Prompt(f"p{i}", [{"role": "user", "content": f"{terms} ="}], str(i), "t")


def _plain(samples) -> list[tuple]:
    return [(s.uid, s.prompt_ids, s.response_ids, s.finish_reason, s.adapter_version) for s in samples]


def _engine_layout(worker) -> tuple:  # run inside each rank actor (pickled by value)
    e = worker.engine
    return type(e).__name__, e.world, e.rank, e.cache.table_page_size, e.scheduler.allocator.num_free


def test_two_rank_dcp_replica_returns_the_single_engine_samples(ray_local, tmp_path):
    """Seeded sampling (temperature 1) with a non-zero adapter, prompts of up to 22 blocks: both ranks
    return the single engine's samples, and the replica serves a sequence longer than `max_pages`
    pages of one engine (each rank holds every other page)."""
    out = f"output_dir={tmp_path}"
    cfg = load_config("quickstart", [out, *QUICK, *DCP, f"rollout.max_pages={DCP_PAGES}"])
    base = str(prepare_base(cfg, tmp_path))
    single = RolloutWorker(load_config("quickstart", [out, *QUICK]), base)
    prompts = [_long_prompt(i) for i in range(3)]
    tok = single.tokenizer
    lengths = [len(tok.chat_prompt(p.messages)) for p in prompts]
    assert min(lengths) > 4 * TINY.index_topk_blocks * TINY.index_block_size  # the indexer drops blocks
    assert max(lengths) > DCP_PAGES * TINY.index_block_size  # more than one engine's max_pages hold
    replica = RolloutReplica(lambda r: ray.remote(num_cpus=0)(RolloutRank).remote(cfg, base, 0, r, 2), 2)
    try:
        replica.form_group()
        layouts = ray.get([a.__ray_call__.remote(_engine_layout) for a in replica.ranks])
        gen = torch.Generator().manual_seed(0)
        tensors = {k: (torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v)
                   for k, v in adapter_tensors(single.model).items()}  # fmt: skip
        update = make_update(tensors, 1)
        single.set_adapter(update)
        fetch(replica.set_adapter.remote(update))
        assert fetch(replica.fingerprint.remote()) == single.fingerprint()
        args = (prompts, 2, 1.0, 1.0, 11, 1)
        want = single.generate(*args)
        call = replica.generate.remote(*args)
        got = fetch(call)
        per_rank = ray.get(call.refs)
    finally:
        replica.kill()
    page = TINY.index_block_size
    assert layouts == [("DCPEngine", 2, r, 2 * page, DCP_PAGES) for r in range(2)]
    assert len(want) == 6 and len({tuple(s.response_ids) for s in want}) > 1  # sampled, not degenerate
    for rank, samples in enumerate(per_rank):  # every rank returns the same samples: one engine's
        assert _plain(samples) == _plain(want), f"rank {rank}"
        for a, b in zip(samples, want, strict=True):
            torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)
    assert [s.response_ids for s in got] == [s.response_ids for s in per_rank[0]]


# ------------------------------------------------------------------------------------ trainer runs
@pytest.mark.slow
def test_trainer_with_dcp_engine_replica_matches_a_single_process_engine(ray_local, tmp_path, monkeypatch):
    """Two GRPO steps with eval through `Trainer`: one replica of 2 DCP ranks in a placement group
    gives the samples, metrics and adapter of a 1-process engine."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit(tmp_path / "one")
    _fit(tmp_path / "dcp", *DCP, "ray.placement=pack")
    _same_run(tmp_path / "one", tmp_path / "dcp")


@pytest.mark.reliability
def test_dead_dcp_rank_restarts_the_replica_and_the_run_is_unchanged(ray_local, tmp_path, monkeypatch):
    """One rank of the DCP replica dies (os._exit) in step 1's rollout: the replica is killed and
    restarted, its group re-formed (a fresh DCPEngine per rank), the adapter re-sent and the rollout
    re-run with the same seeds."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit(tmp_path / "one")
    _fit(tmp_path / "dcp", *DCP, "trainer.fault_injection=rollout.generate@1")
    _same_run(tmp_path / "one", tmp_path / "dcp")
    rows = [json.loads(line) for line in (tmp_path / "dcp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["faults/rollout_restarts"] == 1.0
