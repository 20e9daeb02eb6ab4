"""Expert-range loading: an expert-parallel rank reads, allocates and fingerprints only its experts.

`load_model(path, expert_range=(lo, hi))` against the whole model loaded from the same checkpoint:
the shard's bytes are the whole bank's rows, the other experts' bytes are never read (a damaged shard
holding only them does not matter), the LoRA adapter drawn on it equals the whole model's, and on 2
and 3 gloo processes the range-loaded DEP model computes the whole model's logits and gradients and
the whole base's fingerprint (each rank hashes its experts, the digests are gathered)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from model.checkpoint import (
    _EXPERT_RE,
    INDEX_FILE,
    CheckpointError,
    base_fingerprint,
    load_model,
    save_model,
)
from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora, lora_state_dict
from model.layers.moe import ExpertBank
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.expert_parallel import apply_expert_parallel, expert_ranges
from model.parallel.groups import launch_local

ATOL = 1e-5
LORA = LoRAConfig(r=4, alpha=8.0, routed_experts=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny preset (8 NVFP4 experts in 3 MoE layers) saved in ~20 KB shards: about one expert each."""
    path = tmp_path_factory.mktemp("ranged") / "ckpt"
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(seed=0)
    save_model(model, path, max_shard_bytes=20_000)
    return path


def _banks(model) -> dict[str, ExpertBank]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertBank)}


def _policy(path, expert_range=None) -> MiniMaxM3ForCausalLM:
    """fp32 base + adapter with non-zero B factors (drawn by name order: the same on every layout)."""
    model = apply_lora(load_model(path, dtype=torch.float32, expert_range=expert_range), LORA, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _inputs(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randint(3, 512, (1, [11, 6, 9][rank]), generator=gen)


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(ids)
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_range_load_holds_exactly_the_whole_banks_rows(ckpt):
    whole = load_model(ckpt, dtype=torch.float32)
    part = load_model(ckpt, dtype=torch.float32, expert_range=(3, 6))
    for name, bank in _banks(part).items():
        full = _banks(whole)[name]
        assert (bank.first_expert, bank.num_experts, bank.total_experts, bank.is_partial) == (3, 3, 8, True)
        for t_name, t in [*bank.named_parameters(recurse=False), *bank.named_buffers(recurse=False)]:
            want = getattr(full, t_name)[3:6]
            assert t.shape == want.shape and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), t_name
    # Everything outside the banks is the whole model's.
    whole_sd, part_sd = whole.state_dict(), part.state_dict()
    for n, t in part_sd.items():
        if ".experts." not in n:
            assert torch.equal(t, whole_sd[n]), n


def test_range_load_never_reads_other_experts_bytes(ckpt, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    by_file: dict[str, list[str]] = {}
    for name, f in json.loads((damaged / INDEX_FILE).read_text())["weight_map"].items():
        by_file.setdefault(f, []).append(name)
    # A shard holding nothing but experts 6 and 7: outside the range [0, 6) loaded below.
    victim = next(
        f
        for f, names in sorted(by_file.items())
        if all((m := _EXPERT_RE.match(n)) and int(m.group(3)) >= 6 for n in names)
    )
    (damaged / victim).write_bytes((damaged / victim).read_bytes()[:100])
    with pytest.raises(CheckpointError, match=victim):
        load_model(damaged, dtype=torch.float32)
    part = load_model(damaged, dtype=torch.float32, expert_range=(0, 6))
    assert all(b.num_experts == 6 for b in _banks(part).values())


def test_adapter_on_a_range_loaded_model_equals_the_whole_models(ckpt):
    want = lora_state_dict(_policy(ckpt))
    got = lora_state_dict(_policy(ckpt, expert_range=(5, 8)))
    assert set(got) == set(want) and any(".experts.lora." in n for n in got)
    for n, t in want.items():
        assert torch.equal(got[n], t), n


def test_bad_range_and_misuse_of_a_partial_model_give_clear_errors(ckpt, tmp_path):
    for bad in [(3, 3), (0, 9), (-1, 2)]:
        with pytest.raises(CheckpointError, match="expert_ranges"):
            load_model(ckpt, expert_range=bad)
    part = load_model(ckpt, dtype=torch.float32, expert_range=(0, 4))
    with pytest.raises(RuntimeError, match="apply_expert_parallel"):
        part(torch.tensor([[5, 6, 7]]))
    with pytest.raises(CheckpointError, match="whole model"):
        save_model(part, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        base_fingerprint(part)
    with pytest.raises(ValueError, match=r"rank 0 of 1 owns experts \[0, 8\) but .*expert_range="):
        apply_expert_parallel(part, None)  # a world of one owns all 8 experts


def _ranged_rank(path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = expert_ranges(8, world)[rank]
    model = apply_expert_parallel(_policy(path, expert_range=(lo, hi)), None)
    logits, grads = _step(model, _inputs(rank))
    stored = sum(b.w1_weight.numel() for b in _banks(model).values())
    return {"logits": logits, "grads": grads, "fingerprint": base_fingerprint(model), "w1_numel": stored}


@pytest.mark.parametrize("world", [2, 3])
def test_range_loaded_dep_model_equals_the_whole_model_and_its_fingerprint(ckpt, world):
    results = launch_local(_ranged_rank, world, ckpt)
    ref = _policy(ckpt)
    whole_w1 = sum(b.w1_weight.numel() for b in _banks(ref).values())
    for r, res in enumerate(results):
        lo, hi = expert_ranges(8, world)[r]
        assert res["w1_numel"] * 8 == whole_w1 * (hi - lo)  # only its experts were ever allocated
        logits, _ = _step(ref, _inputs(r))  # accumulates the reference's grads over every rank's tokens
        torch.testing.assert_close(res["logits"], logits, atol=ATOL, rtol=0)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(results[0]["grads"]) == set(want) and any(".experts.lora." in n for n in want)
    for name, g in want.items():
        torch.testing.assert_close(sum(res["grads"][name] for res in results), g, atol=ATOL, rtol=0, msg=name)
    whole_fp = base_fingerprint(load_model(ckpt, dtype=torch.float32))
    assert {res["fingerprint"] for res in results} == {whole_fp}
