"""The plugin's LoRA layers for MiniMax-M3's fused q|k|v|index_q|index_k projection, on vLLM's own
layers and punica CPU kernels: slice by slice the output is W x + s B A x, at TP = 1 and on each rank
of a real TP = 2 group (two gloo processes), with KV heads sharded (2 KV heads) and replicated (1).

Per rank the expected slices are cut from the full computation the way vLLM's weight loader shards
the base: q by query heads, k / v / index_q by KV heads (rank // replicas), index_k whole. index_k is
not trained here and must equal the base output exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

pytest.importorskip("vllm")

D, HEAD, HEADS, R, SCALE, TOKENS = 64, 16, 4, 8, 2.0, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(kv_heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Full (unsharded) base weight and LoRA (A, B) per slice; index_k has no adapter."""
    g = torch.Generator().manual_seed(kv_heads)
    rows = {
        "q": HEADS * HEAD,
        "k": kv_heads * HEAD,
        "v": kv_heads * HEAD,
        "index_q": kv_heads * HEAD,
        "index_k": HEAD,
    }
    out = {}
    for name, n in rows.items():
        w = torch.randn(n, D, generator=g) / D**0.5
        trained = name != "index_k"
        a = torch.randn(R, D, generator=g) / D**0.5 if trained else None
        b = torch.randn(n, R, generator=g) * 0.3 if trained else None
        out[name] = (w, a, b)
    return out


def _expected_slice(name, w, a, b, x, tp, rank, kv_heads):
    full = x @ w.T
    if a is not None:
        full = full + SCALE * (x @ a.T) @ b.T
    if name == "index_k":
        return full
    if name == "q":
        n = full.shape[1] // tp
        return full[:, rank * n : (rank + 1) * n]
    local_kv = max(1, kv_heads // tp)
    shard = rank // max(1, tp // kv_heads)
    return full[:, shard * local_kv * HEAD : (shard + 1) * local_kv * HEAD]


def init_tp(tp: int, rank: int, port: int) -> None:
    """A real vLLM tensor-parallel group of `tp` CPU processes (gloo), as vLLM's CPU worker makes it."""
    import os

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets before its TP group exists
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)


def run_layer(tp: int, rank: int, kv_heads: int) -> dict[str, float]:
    """Build the base layer and the plugin's LoRA layer on this rank; max |got - expected| per slice."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.model_executor.layers.linear import MinimaxM3QKVParallelLinearWithIndexer

    from rollout.vllm_m3.lora import FIVE_SLICES, M3QKVIndexerWithLoRA

    with set_current_vllm_config(VllmConfig()):
        base = MinimaxM3QKVParallelLinearWithIndexer(
            D, HEAD, HEADS, kv_heads, kv_heads, HEAD, bias=False, prefix="qkv_proj"
        )
        weights = _weights(kv_heads)
        for name, (w, _, _) in weights.items():
            base.weight_loader(base.weight, w, name)
        base.quant_method.process_weights_after_loading(base)  # as vLLM's loader does (CPU GEMM setup)
        lcfg = LoRAConfig(max_lora_rank=R, max_loras=1, lora_dtype=torch.float32)
        assert M3QKVIndexerWithLoRA.can_replace_layer(
            source_layer=base, lora_config=lcfg, packed_modules_list=list(FIVE_SLICES)
        )
        layer = M3QKVIndexerWithLoRA(base)
        layer.create_lora_weights(1, lcfg)
        # vLLM folds the scaling into B when it packs an adapter (LoRALayerWeights.optimize)
        layer.set_lora(
            0,
            [a for _, a, _ in weights.values()],
            [None if b is None else SCALE * b for _, _, b in weights.values()],
        )
        punica = PunicaWrapperCPU(max_num_batched_tokens=16, max_batches=2, device="cpu")
        punica.update_metadata(LoRAMapping([1] * TOKENS, [1], is_prefill=True), [1], 1, 512)
        layer.set_mapping(punica)
        x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            got = layer(x)[0].split(list(layer.output_slices), dim=-1)
            base_out = base(x)[0].split(list(layer.output_slices), dim=-1)
        errors = {}
        for (name, (w, a, b)), g in zip(weights.items(), got, strict=True):
            errors[name] = (g - _expected_slice(name, w, a, b, x, tp, rank, kv_heads)).abs().max().item()
        errors["index_k_vs_base"] = (got[4] - base_out[4]).abs().max().item()
        errors["n_slices"] = float(layer.n_slices)
    return errors


def _child(tp, rank, port, queue):
    """One rank: both KV layouts (2 heads: sharded at TP 2; 1: replicated), then at TP 1 the dense
    layer's three-of-five slices."""
    try:
        init_tp(tp, rank, port)
        result = {kv: run_layer(tp, rank, kv) for kv in (2, 1)}
        if tp == 1:
            result["dense"] = run_dense()
        queue.put((rank, result))
    except Exception as e:  # reported to the parent, which fails the test with it
        queue.put((rank, repr(e)))


def _run_ranks(tp: int) -> dict:
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_child, args=(tp, r, port, q)) for r in range(tp)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    for rank in range(tp):
        assert isinstance(results[rank], dict), results[rank]
    return results


def _check(errors: dict[str, float]) -> None:
    assert errors["n_slices"] == 5
    assert errors["index_k_vs_base"] == 0.0, "an untrained index_k slice must stay the base output"
    for name in ("q", "k", "v", "index_q", "index_k"):
        assert errors[name] < 1e-5, (name, errors)


def test_five_slice_lora_equals_base_plus_scaled_BA_at_tp1_and_dense_layer_takes_three():
    (result,) = _run_ranks(1).values()
    for kv in (2, 1):
        _check(result[kv])
    assert result["dense"] == ("ok", "refused"), result["dense"]


def test_five_slice_lora_slices_per_rank_at_tp2():
    for result in _run_ranks(2).values():
        for kv in (2, 1):
            _check(result[kv])


def run_dense() -> tuple[str, str]:
    """The dense layers' QKVParallelLinear under the five-name list: q/k/v factors land in its three
    slices (B @ A each), index factors are refused."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.lora import LoRAConfig
    from vllm.model_executor.layers.linear import QKVParallelLinear

    from rollout.vllm_m3.lora import FIVE_SLICES, M3DenseQKVWithLoRA, effective_delta

    with set_current_vllm_config(VllmConfig()):
        base = QKVParallelLinear(D, HEAD, HEADS, 2, bias=False, prefix="qkv_proj")
        base.quant_method.process_weights_after_loading(base)
        lcfg = LoRAConfig(max_lora_rank=R, max_loras=1, lora_dtype=torch.float32)
        assert M3DenseQKVWithLoRA.can_replace_layer(
            source_layer=base, lora_config=lcfg, packed_modules_list=list(FIVE_SLICES)
        )
        layer = M3DenseQKVWithLoRA(base)
        layer.create_lora_weights(1, lcfg)
        sizes = (HEADS * HEAD, 2 * HEAD, 2 * HEAD)
        a = [torch.randn(R, D) for _ in sizes] + [None, None]
        b = [torch.randn(n, R) for n in sizes] + [None, None]
        layer.set_lora(0, a, b)
        ok = all(torch.allclose(d, bi @ ai) for d, ai, bi in zip(effective_delta(layer), a, b))
        try:
            layer.set_lora(0, [*a[:3], torch.randn(R, D), None], [*b[:3], torch.randn(2 * HEAD, R), None])
            refused = "accepted"
        except ValueError:
            refused = "refused"
    return ("ok" if ok else "wrong deltas", refused)
