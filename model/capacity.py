"""Capacity planner: parameters, checkpoint bytes, KV-cache bytes and concurrent sequences.

What: pure arithmetic over a `ModelConfig` (no model is built, so the full 427e9-parameter M3 answers
instantly): every checkpoint tensor is enumerated with its shape and storage scheme, caches are
counted per token, and a deployment (GPUs x memory, tp / ep / dep) turns that into the number of
full-context sequences that fit. Why: the headline serving claim (docs/FACTS.md, "Headline figures")
must follow from first principles, not from a measured engine.

Conventions: bytes and decimal GB (1e9 B, as checkpoint sizes are quoted); `active_params` excludes
embeddings and lm_head (the "~23B active" convention); byte rules per scheme in the comment below.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal, get_args

from model.config import CacheDtype, ModelConfig

# Counting rules:
# - `total_params`: nn.Parameters of the backbone (embeddings, lm_head unless tied, norms, router);
#   not the `e_score_correction_bias` buffer (its bytes are in the checkpoint) and not the MTP
#   module unless include_mtp. `active_params`: attention, indexer, norms, dense MLPs, shared
#   experts, router and the top-k routed experts one token multiplies through.
# - Bytes per weight value: bf16 2; fp8 1 (+ fp32 weight_scale and input_scale per tensor); MXFP8
#   1 + 1/32; NVFP4 1/2 + 1/16 + fp32 weight_scale_2 per tensor (+ input_scale when W4A4). Router
#   weight and bias fp32.
# - Cache bytes per token and head of width C: bf16 2C, fp8 C, nvfp4 C/2 + C/16 (72 B at C = 128).
#   Main K/V: every layer, 2 sides x kv heads. Index cache: one key head of index_head_dim per
#   sparse layer (`none` = not counted).

Parallel = Literal["tp", "ep", "dep"]
IndexCacheDtype = Literal["bf16", "fp8", "nvfp4", "none"]
GB = 1e9
GROUPS = ("embed_tokens", "lm_head", "attention", "indexer", "norms", "dense_mlp", "shared_experts",
          "router", "routed_experts")  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name of the module (expert 0 stands for `copies` experts)
    group: str  # one of GROUPS
    rows: int
    cols: int  # K, the dim the block scales run along
    scheme: str  # "bf16" / "fp8" / "mxfp8" / "nvfp4" / "fp32"
    copies: int = 1
    is_param: bool = True

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.copies if self.is_param else 0

    def nbytes(self, w4a4: bool = False) -> int:
        n, k = self.rows, self.cols
        per = {
            "fp32": 4 * n * k,
            "bf16": 2 * n * k,
            "fp8": n * k + 8,  # + fp32 weight_scale and input_scale
            "mxfp8": n * k + n * math.ceil(k / 32),
            "nvfp4": n * k // 2 + n * k // 16 + 4 + (4 if w4a4 else 0),
        }[self.scheme]
        return per * self.copies


def _layer_tensors(cfg: ModelConfig, p: str, sparse: bool, moe: bool) -> list[TensorSpec]:
    D, C, Ci = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    dt = cfg.module_dtype
    ts = [TensorSpec(f"{p}.input_layernorm", "norms", 1, D, "bf16"),
          TensorSpec(f"{p}.post_attention_layernorm", "norms", 1, D, "bf16"),
          TensorSpec(f"{p}.self_attn.q_norm", "norms", 1, C, "bf16"),
          TensorSpec(f"{p}.self_attn.k_norm", "norms", 1, C, "bf16")]  # fmt: skip
    for name, rows, cols in (("q_proj", cfg.q_size, D), ("k_proj", cfg.kv_size, D),
                             ("v_proj", cfg.kv_size, D), ("o_proj", D, cfg.q_size)):  # fmt: skip
        ts.append(TensorSpec(f"{p}.self_attn.{name}", "attention", rows, cols, dt(f"{p}.self_attn.{name}")))
    if sparse:
        for name, rows in (("index_q_proj", cfg.index_n_heads * Ci), ("index_k_proj", Ci)):
            ts.append(TensorSpec(f"{p}.self_attn.{name}", "indexer", rows, D, dt(f"{p}.self_attn.{name}")))
        ts += [TensorSpec(f"{p}.self_attn.index_q_norm", "norms", 1, Ci, "bf16"),
               TensorSpec(f"{p}.self_attn.index_k_norm", "norms", 1, Ci, "bf16")]  # fmt: skip

    def mlp(prefix: str, group: str, F: int, gate: str, up: str, down: str, copies: int = 1) -> list:
        return [TensorSpec(f"{prefix}.{gate}", group, F, D, dt(f"{prefix}.{gate}"), copies),
                TensorSpec(f"{prefix}.{up}", group, F, D, dt(f"{prefix}.{up}"), copies),
                TensorSpec(f"{prefix}.{down}", group, D, F, dt(f"{prefix}.{down}"), copies)]  # fmt: skip

    if not moe:
        return ts + mlp(
            f"{p}.mlp", "dense_mlp", cfg.dense_intermediate_size, "gate_proj", "up_proj", "down_proj"
        )
    E, m = cfg.num_local_experts, f"{p}.block_sparse_moe"
    ts += [TensorSpec(f"{m}.gate", "router", E, D, "fp32"),
           TensorSpec(f"{m}.e_score_correction_bias", "router", 1, E, "fp32", is_param=False)]  # fmt: skip
    if cfg.shared_intermediate_size:
        ts += mlp(f"{m}.shared_experts", "shared_experts", cfg.shared_intermediate_size,
                  "gate_proj", "up_proj", "down_proj")  # fmt: skip
    return ts + mlp(f"{m}.experts.0", "routed_experts", cfg.moe_intermediate_size, "w1", "w3", "w2", E)


def checkpoint_tensors(cfg: ModelConfig, include_mtp: bool = False) -> list[TensorSpec]:
    """Every tensor of the checkpoint (routed experts folded into one spec per layer and role)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    ts = [TensorSpec("model.embed_tokens", "embed_tokens", V, D, "bf16"),
          TensorSpec("model.norm", "norms", 1, D, "bf16")]  # fmt: skip
    if not cfg.tie_word_embeddings:
        ts.append(TensorSpec("lm_head", "lm_head", V, D, "bf16"))
    for i in range(cfg.num_hidden_layers):
        ts += _layer_tensors(cfg, f"model.layers.{i}", cfg.is_sparse_layer(i), cfg.is_moe_layer(i))
    if include_mtp:
        # Each MTP module: norms on embedding and hidden, Linear(2D -> D), one sparse+MoE layer.
        for k in range(cfg.num_mtp_modules):
            p = f"mtp.layers.{k}"
            ts += [TensorSpec(f"{p}.{n}", "norms", 1, D, "bf16") for n in ("enorm", "hnorm", "norm")]
            ts.append(TensorSpec(f"{p}.eh_proj", "attention", D, 2 * D, "bf16"))
            ts += _layer_tensors(cfg, p, sparse=True, moe=True)
    return ts


def group_breakdown(cfg: ModelConfig, include_mtp: bool = False) -> dict[str, dict[str, int]]:
    """{group: {"params": n, "bytes": b}} over GROUPS."""
    out = {g: {"params": 0, "bytes": 0} for g in GROUPS}
    w4a4 = cfg.quantization.nvfp4_act_quant
    for t in checkpoint_tensors(cfg, include_mtp):
        out[t.group]["params"] += t.params
        out[t.group]["bytes"] += t.nbytes(w4a4)
    return out


def num_parameters(cfg: ModelConfig, *, active: bool = False, include_mtp: bool = False) -> int:
    """Total backbone parameters, or active per token (embeddings and lm_head excluded)."""
    br = group_breakdown(cfg, include_mtp)
    if not active:
        return sum(v["params"] for v in br.values())
    routed = br["routed_experts"]["params"] * cfg.num_experts_per_tok // max(cfg.num_local_experts, 1)
    skip = ("embed_tokens", "lm_head", "routed_experts")
    return routed + sum(v["params"] for g, v in br.items() if g not in skip)


def checkpoint_bytes(cfg: ModelConfig, include_mtp: bool = False) -> int:
    return sum(v["bytes"] for v in group_breakdown(cfg, include_mtp).values())


def cache_bytes_per_head(dtype: str, C: int) -> float:
    """Bytes one token occupies for one head of width C (one side)."""
    nvfp4 = C / 2 + C / 16  # 4over6 changes how block scales are chosen, not the layout
    return {"bf16": 2 * C, "fp8": C, "nvfp4": nvfp4, "nvfp4_4over6": nvfp4, "none": 0}[dtype]


def kv_bytes_per_token(cfg: ModelConfig, kv_heads: int | None = None) -> int:
    """Main K/V bytes per token over all layers (per-layer dtype overrides honoured)."""
    N = cfg.num_key_value_heads if kv_heads is None else kv_heads
    per = sum(2 * N * cache_bytes_per_head(cfg.kv_dtype_for_layer(i), cfg.head_dim)
              for i in range(cfg.num_hidden_layers))  # fmt: skip
    return int(per)


def index_cache_bytes_per_token(cfg: ModelConfig, dtype: IndexCacheDtype | None = None) -> int:
    """Indexer key-cache bytes per token: one key head per sparse layer."""
    dtype = cfg.index_cache_dtype if dtype is None else dtype
    n_sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    return int(n_sparse * cache_bytes_per_head(dtype, cfg.index_head_dim))


@dataclass(frozen=True)
class Deployment:
    """How the model is served. tp: every tensor split N ways, KV heads split (replicated when
    N > kv heads), the one-head index cache replicated. ep: attention tensor-parallel as tp, routed
    experts placed whole, ceil(E/N) per GPU. dep: attention, dense, shared, embeddings replicated
    (data-parallel attention), routed experts ceil(E/N) per GPU, every GPU holds the whole KV of
    its own sequences. `reserve_gb` is kept off the KV budget for activations, CUDA-graph pools
    and NCCL buffers (vLLM measures it by a profiling forward at max_num_batched_tokens=8192; for
    M3 that is ~0.1 GB per hidden-state copy, ~0.8 GB of MoE dispatch buffers, ~0.8 GB of fp32
    logits for 1024 rows, plus fragmentation: 8 GB is a round, conservative figure)."""

    gpus: int
    gpu_memory_gb: float
    parallel: Parallel
    context_tokens: int
    gpu_memory_utilization: float = 0.9  # vLLM's default
    reserve_gb: float = 8.0
    include_mtp: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus} must be >= 1")
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb={self.gpu_memory_gb} must be > 0")
        if self.parallel not in get_args(Parallel):
            raise ValueError(f"parallel={self.parallel!r}; choose one of {list(get_args(Parallel))}")
        if self.context_tokens < 1:
            raise ValueError(f"context_tokens={self.context_tokens} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.reserve_gb < 0:
            raise ValueError(f"reserve_gb={self.reserve_gb} must be >= 0")


def plan(cfg: ModelConfig, dep: Deployment, kv_dtype: CacheDtype | None = None,
         index_cache_dtype: IndexCacheDtype | None = None) -> dict:  # fmt: skip
    """Everything the CLI prints, as a JSON-able dict. `kv_dtype` replaces the config's base KV
    dtype (its per-layer overrides still apply); `index_cache_dtype` likewise ('none' = 0)."""
    if kv_dtype is not None:
        cfg = dataclasses.replace(cfg, kv_cache_dtype=kv_dtype)
    idx_dtype = cfg.index_cache_dtype if index_cache_dtype is None else index_cache_dtype
    if dep.context_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"context {dep.context_tokens} exceeds max_position_embeddings={cfg.max_position_embeddings}"
        )
    br = group_breakdown(cfg, dep.include_mtp)
    total_bytes = sum(v["bytes"] for v in br.values())
    expert_bytes, norm_bytes = br["routed_experts"]["bytes"], br["norms"]["bytes"]
    E, N = cfg.num_local_experts, dep.gpus
    expert_share = math.ceil(E / N) / E if E else 0.0
    if dep.parallel == "tp":
        weights = (total_bytes - norm_bytes) / N + norm_bytes
    elif dep.parallel == "ep":
        weights = (total_bytes - expert_bytes - norm_bytes) / N + norm_bytes + expert_bytes * expert_share
    else:
        weights = total_bytes - expert_bytes + expert_bytes * expert_share
    kv_tok = kv_bytes_per_token(cfg)
    idx_tok = index_cache_bytes_per_token(cfg, idx_dtype)
    kv_heads_gpu = (
        cfg.num_key_value_heads if dep.parallel == "dep" else math.ceil(cfg.num_key_value_heads / N)
    )
    per_tok_gpu = kv_bytes_per_token(cfg, kv_heads_gpu) + idx_tok
    block = cfg.index_block_size  # KV pages are one indexer block
    seq_tokens = math.ceil(dep.context_tokens / block) * block
    per_seq_gpu = seq_tokens * per_tok_gpu
    budget = dep.gpu_memory_gb * GB * dep.gpu_memory_utilization - dep.reserve_gb * GB - weights
    replicas = N if dep.parallel == "dep" else 1  # independent KV pools
    seqs_gpu = max(0, math.floor(budget / per_seq_gpu)) if per_seq_gpu else 0
    blocks_gpu = max(0, math.floor(budget / (block * per_tok_gpu))) if per_tok_gpu else 0
    return {
        "kv_dtype": cfg.kv_cache_dtype,
        "index_cache_dtype": idx_dtype,
        **dataclasses.asdict(dep),
        "total_params": num_parameters(cfg, include_mtp=dep.include_mtp),
        "active_params": num_parameters(cfg, active=True, include_mtp=False),
        "embedding_params": br["embed_tokens"]["params"] + br["lm_head"]["params"],
        "checkpoint_bytes": total_bytes,
        "kv_bytes_per_token": kv_tok,
        "index_cache_bytes_per_token": idx_tok,
        "cache_bytes_per_token_per_gpu": per_tok_gpu,
        "cache_bytes_per_sequence_per_gpu": per_seq_gpu,
        "weights_bytes_per_gpu": int(weights),
        "kv_budget_bytes_per_gpu": int(budget),
        "max_concurrent_sequences": replicas * seqs_gpu,
        "max_cached_tokens": replicas * blocks_gpu * block,
        "groups": br,
    }


def _parse_tokens(s: str) -> int:
    """'262144', '256K' (x1024) or '1M' (x1024^2)."""
    mult = {"K": 1024, "M": 1024**2}.get(s[-1:].upper(), 1)
    try:
        n = int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--context {s!r}: give tokens as an int, or with K/M (256K)"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--context {s!r} must be >= 1 token")
    return n


def _positive(kind: type):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
        return v

    return parse


def _load(path: str) -> ModelConfig:
    if os.path.isdir(path):
        return ModelConfig.from_pretrained(path)
    with open(path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def _fmt_table(r: dict, name: str) -> str:
    g = lambda b: f"{b / GB:,.2f} GB" if b >= GB else f"{b / 1e6:,.2f} MB"
    rows = [
        ("model", name),
        ("total params", f"{r['total_params']:,}"),
        ("active params / token", f"{r['active_params']:,} (embeddings, lm_head excluded)"),
        ("checkpoint", g(r["checkpoint_bytes"])),
        (f"KV bytes / token ({r['kv_dtype']})", f"{r['kv_bytes_per_token']:,}"),
        (f"index cache bytes / token ({r['index_cache_dtype']})", f"{r['index_cache_bytes_per_token']:,}"),
        (
            "deployment",
            f"{r['parallel']} x {r['gpus']} GPUs x {r['gpu_memory_gb']} GB, "
            f"util {r['gpu_memory_utilization']}, reserve {r['reserve_gb']} GB",
        ),
        ("weights / GPU", g(r["weights_bytes_per_gpu"])),
        ("KV budget / GPU", g(r["kv_budget_bytes_per_gpu"])),
        (f"cache / sequence / GPU ({r['context_tokens']:,} tok)", g(r["cache_bytes_per_sequence_per_gpu"])),
        ("max concurrent sequences", f"{r['max_concurrent_sequences']:,}"),
        ("max cached tokens", f"{r['max_cached_tokens']:,}"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'group':<16}{'params':>18}{'bytes':>16}")
    lines += [f"{k:<16}{v['params']:>18,}{g(v['bytes']):>16}" for k, v in r["groups"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.capacity", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="one of: " + ", ".join(("m3", "m3.1-flash", "small", "tiny")))
    src.add_argument("--config", help="config.json, or a directory holding one")
    ap.add_argument("--kv-dtype", choices=list(get_args(CacheDtype)), help="default: the config's")
    ap.add_argument(
        "--index-cache-dtype", choices=list(get_args(IndexCacheDtype)), help="default: the config's"
    )
    ap.add_argument("--gpus", type=_positive(int), required=True)
    ap.add_argument("--gpu-memory-gb", type=_positive(float), required=True, help="decimal GB per GPU")
    ap.add_argument("--parallel", choices=list(get_args(Parallel)), required=True)
    ap.add_argument(
        "--context", type=_parse_tokens, required=True, help="tokens per sequence, e.g. 262144 or 256K"
    )
    ap.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.9)
    ap.add_argument("--reserve-gb", type=float, default=8.0, help="activation/workspace reserve per GPU")
    ap.add_argument("--include-mtp", action="store_true", help="count the MTP module's weights")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.gpu_memory_utilization > 1:
        ap.error(f"--gpu-memory-utilization {a.gpu_memory_utilization} must be in (0, 1], e.g. 0.9")
    if a.reserve_gb < 0:
        ap.error(f"--reserve-gb {a.reserve_gb} must be >= 0")
    try:
        cfg = ModelConfig.preset(a.preset) if a.preset else _load(a.config)
        dep = Deployment(a.gpus, a.gpu_memory_gb, a.parallel, a.context, a.gpu_memory_utilization,
                         a.reserve_gb, a.include_mtp)  # fmt: skip
        r = plan(cfg, dep, a.kv_dtype, a.index_cache_dtype)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    r["model"] = a.preset or a.config
    print(json.dumps(r, indent=2) if a.json else _fmt_table(r, r["model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
