"""Tensor names of the transformers port (`MiniMaxM3VLForCausalLM`) and the project's checkpoint names.

What: `to_port_names` / `from_port_names` translate a stream of (name, tensor) pairs between the two
layouts: the project (= released checkpoint, vLLM, ModelOpt) names `block_sparse_moe.*`,
`self_attn.index_{q,k}_{proj,norm}`, separate `gate_proj` / `up_proj`, one tensor per expert
(`experts.{e}.w1|w2|w3.weight`); and the port's `mlp.*`, `self_attn.indexer.*`, fused
`gate_up_proj` (gate rows first) and stacked experts `experts.gate_up_proj` [E, 2F, D] /
`experts.down_proj` [E, D, F]. Why: transformers has no renaming for a `minimax_m3_vl_text`
directory, so a float checkpoint it loads with AutoModelForCausalLM must hold the port's names.

Invariants: from_port_names(to_port_names(x)) == x (float tensors, same values); names that are
already in the target layout pass through unchanged, so either layout can be fed to either side;
only float tensors are ever fused or stacked (quantized checkpoints keep the project's names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# project -> port, applied in order (the bias rename must precede the generic block_sparse_moe one)
_TO_PORT = (
    (".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
    (".block_sparse_moe.", ".mlp."),
    (".self_attn.index_q_proj.", ".self_attn.indexer.q_proj."),
    (".self_attn.index_k_proj.", ".self_attn.indexer.k_proj."),
    (".self_attn.index_q_norm.", ".self_attn.indexer.q_norm."),
    (".self_attn.index_k_norm.", ".self_attn.indexer.k_norm."),
)
_FROM_PORT = (
    (".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
    (".mlp.gate.weight", ".block_sparse_moe.gate.weight"),
    (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
    (".self_attn.indexer.q_proj.", ".self_attn.index_q_proj."),
    (".self_attn.indexer.k_proj.", ".self_attn.index_k_proj."),
    (".self_attn.indexer.q_norm.", ".self_attn.index_q_norm."),
    (".self_attn.indexer.k_norm.", ".self_attn.index_k_norm."),
)
_PROJECT_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_PORT_EXPERTS = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED = re.compile(r"^(.*)\.gate_up_proj\.weight$")
_SPLIT = re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$")


def port_name(name: str) -> str:
    """One project name -> the port's name (no fusing: gate_proj stays gate_proj)."""
    for src, dst in _TO_PORT:
        name = name.replace(src, dst)
    return name


def to_port_names(
    items: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Project-named float tensors -> the port's names. gate/up pairs are fused as soon as both
    arrived; a layer's experts are stacked once all `num_experts` x 3 of them arrived (one layer
    of experts is held at a time when they arrive layer by layer, as `state_for_save` yields them)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    banks: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in items:
        m = _PROJECT_EXPERT.match(name)
        if m:
            layer, e, proj = m.group(1), int(m.group(2)), m.group(3)
            bank = banks.setdefault(layer, {})
            bank[(e, proj)] = t
            if len(bank) == 3 * num_experts:
                del banks[layer]
                w1, w2, w3 = ([bank[(i, p)] for i in range(num_experts)] for p in ("w1", "w2", "w3"))
                yield f"{layer}.mlp.experts.gate_up_proj", torch.cat([torch.stack(w1), torch.stack(w3)], 1)
                yield f"{layer}.mlp.experts.down_proj", torch.stack(w2)
            continue
        name = port_name(name)
        m = _SPLIT.match(name)
        if m:
            pair = halves.setdefault(m.group(1), {})
            pair[m.group(2)] = t
            if len(pair) == 2:
                del halves[m.group(1)]
                yield f"{m.group(1)}.gate_up_proj.weight", torch.cat([pair["gate_proj"], pair["up_proj"]])
            continue
        yield name, t
    if halves or banks:
        left = sorted(halves) + sorted(banks)
        raise ValueError(f"to_port_names: incomplete gate/up pairs or expert banks at the end: {left[:5]}")


def from_port_names(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The port's names -> project names: fused gate_up split in halves (gate first), stacked experts
    split per expert; project names pass through."""
    for name, t in items:
        m = _PORT_EXPERTS.match(name)
        if m:
            layer = m.group(1)
            if m.group(2) == "gate_up_proj":  # [E, 2F, D]
                f = t.shape[1] // 2
                for e in range(t.shape[0]):
                    yield f"{layer}.block_sparse_moe.experts.{e}.w1.weight", t[e, :f].contiguous()
                    yield f"{layer}.block_sparse_moe.experts.{e}.w3.weight", t[e, f:].contiguous()
            else:  # [E, D, F]
                for e in range(t.shape[0]):
                    yield f"{layer}.block_sparse_moe.experts.{e}.w2.weight", t[e].contiguous()
            continue
        for src, dst in _FROM_PORT:
            name = name.replace(src, dst)
        m = _FUSED.match(name)
        if m:
            half = t.shape[0] // 2
            yield f"{m.group(1)}.gate_proj.weight", t[:half].contiguous()
            yield f"{m.group(1)}.up_proj.weight", t[half:].contiguous()
            continue
        yield name, t
