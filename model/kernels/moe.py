"""Routed-expert execution: y = sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for every token t.

Why: the MoE layer's hot path; each expert is w2 @ swigluoai(w1 @ x, w3 @ x) with weights in the
bank's frozen storage format (float, NVFP4 or MXFP8), so gradients go to x, the routing weights and
per-expert LoRA (the bank's `lora` hook) only. Dispatch, for an NVFP4 bank with bf16 tokens on CUDA
(or under TRITON_INTERPRET=1): inference without adapter -> `model.kernels.triton_moe`; gradients or
an expert adapter -> `model.kernels.triton_moe_train`; everything else the torch path (slots sorted by
expert, one call per expert group, fp32 scatter-add). `moe_experts_ref` is the spec (a plain loop).
Also the activation `swigluoai` (experts, dense MLP, shared expert): `swigluoai_ref` in torch, one
launch of `model.kernels.triton_swiglu` in inference mode.

Invariants: every path uses element-for-element the same weights (dequantized to x's dtype); a token's
K contributions are accumulated in fp32 and rounded once, a shared-expert term added after that
rounding; the frozen storage never gets a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

from model.kernels.inference_path import triton_inference_path
from model.kernels.nvfp4_linear import nvfp4_linear
from model.kv_cache import is_static_shapes

# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k slots per token, S = T*K
# token-slots, M tokens of one expert group, I / O a projection's input / output features.

try:  # Triton is optional on CPU machines: without it every call takes the torch path.
    from model.kernels.triton_common import triton_available
    from model.kernels.triton_moe import moe_nvfp4_triton, triton_moe_supported
    from model.kernels.triton_moe_train import moe_nvfp4_train, triton_moe_train_supported
except ImportError:  # pragma: no cover - depends on the install
    triton_available = None
from model.mxfp8 import dequantize_mxfp8

if TYPE_CHECKING:
    from model.layers.moe import ExpertBank

Proj = Literal["w1", "w2", "w3"]
"""Expert projections, named as the checkpoint names them: w1 gate [F, D], w3 up [F, D], w2 down [D, F]."""


class ExpertDelta(Protocol):
    """Extension point for per-expert adapters (LoRA): the extra output of projection `proj` of expert
    `e` on its tokens `x_MI`, added to the frozen projection's output. Set as `ExpertBank.lora`."""

    def __call__(self, e: int, proj: Proj, x_MI: torch.Tensor) -> torch.Tensor: ...


def swigluoai_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """MiniMax's clamped SwiGLU: g * sigmoid(alpha * g) * (clamp(up, +-limit) + 1), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1.0)


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swigluoai_ref`; in inference mode one Triton launch (`model.kernels.triton_swiglu`, the same
    bits on CUDA) where Triton runs. The one dispatch point for this op."""
    if triton_inference_path(gate):
        from model.kernels.triton_swiglu import swigluoai_supported, swigluoai_triton

        if swigluoai_supported(gate, up):
            return swigluoai_triton(gate, up, alpha, limit)
    return swigluoai_ref(gate, up, alpha, limit)


class _MXFP8Linear(torch.autograd.Function):
    """x @ dequant(W).T with W dequantized whole (MXFP8 is 1 byte/value: no tiling needed), but
    recomputed in backward so autograd never keeps a float copy of every expert alive."""

    @staticmethod
    def forward(ctx, x_MI, values_OI, scales_OI32):
        ctx.save_for_backward(values_OI, scales_OI32)
        ctx.x_dtype = x_MI.dtype
        return F.linear(x_MI, dequantize_mxfp8(values_OI, scales_OI32, x_MI.dtype))

    @staticmethod
    def backward(ctx, grad_y_MO):
        values_OI, scales_OI32 = ctx.saved_tensors
        return grad_y_MO @ dequantize_mxfp8(values_OI, scales_OI32, ctx.x_dtype), None, None


def _expert_linear(bank: ExpertBank, proj: Proj, e: int, x_MI: torch.Tensor) -> torch.Tensor:
    """One projection of one expert on its tokens, in the bank's storage format (+ the LoRA hook)."""
    w = getattr(bank, f"{proj}_weight")
    if bank.fmt == "nvfp4":
        y = nvfp4_linear(
            x_MI, w[e], getattr(bank, f"{proj}_weight_scale")[e], getattr(bank, f"{proj}_weight_scale_2")[e]
        )
    elif bank.fmt == "mxfp8":
        y = _MXFP8Linear.apply(x_MI, w[e], getattr(bank, f"{proj}_weight_scale")[e])
    else:
        y = F.linear(x_MI, w[e].to(x_MI.dtype))
    if bank.lora is not None:
        y = y + bank.lora(e, proj, x_MI)
    return y


def _expert_mlp(bank: ExpertBank, e: int, x_MD: torch.Tensor) -> torch.Tensor:
    gate_MF = _expert_linear(bank, "w1", e, x_MD)
    up_MF = _expert_linear(bank, "w3", e, x_MD)
    return _expert_linear(bank, "w2", e, swigluoai(gate_MF, up_MF, bank.swiglu_alpha, bank.swiglu_limit))


def _check_args(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, bank: ExpertBank) -> None:
    if x_TD.dim() != 2 or x_TD.shape[1] != bank.hidden_size:
        raise ValueError(f"moe_experts: x must be [T, {bank.hidden_size}], got {tuple(x_TD.shape)}")
    if (
        ids_TK.dim() != 2
        or ids_TK.shape[0] != x_TD.shape[0]
        or ids_TK.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"moe_experts: topk_ids must be int32/int64 [T={x_TD.shape[0]}, K], "
            f"got {ids_TK.dtype} {tuple(ids_TK.shape)}"
        )
    if tuple(weights_TK.shape) != tuple(ids_TK.shape) or not weights_TK.is_floating_point():
        raise ValueError(
            f"moe_experts: topk_weights must be a float tensor shaped like topk_ids {tuple(ids_TK.shape)}, "
            f"got {weights_TK.dtype} {tuple(weights_TK.shape)}"
        )


def moe_experts_ref(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, bank: ExpertBank
) -> torch.Tensor:
    """The spec: for each token and slot, run the chosen expert with its whole dequantized weights."""
    _check_args(x_TD, topk_ids_TK, topk_weights_TK, bank)
    rows = []
    for t in range(x_TD.shape[0]):
        acc_D = x_TD.new_zeros(x_TD.shape[1], dtype=torch.float32)
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])  # SYNC: reference loop, correctness over speed
            w1_FD, w3_FD, w2_DF = bank.dequantized(e, x_TD.dtype)
            x_1D = x_TD[t : t + 1]
            gate_1F = F.linear(x_1D, w1_FD)
            up_1F = F.linear(x_1D, w3_FD)
            if bank.lora is not None:
                gate_1F = gate_1F + bank.lora(e, "w1", x_1D)
                up_1F = up_1F + bank.lora(e, "w3", x_1D)
            act_1F = swigluoai_ref(gate_1F, up_1F, bank.swiglu_alpha, bank.swiglu_limit)
            y_1D = F.linear(act_1F, w2_DF)
            if bank.lora is not None:
                y_1D = y_1D + bank.lora(e, "w2", act_1F)
            acc_D = acc_D + topk_weights_TK[t, k].float() * y_1D[0].float()
        rows.append(acc_D)
    if not rows:
        return x_TD.new_zeros(x_TD.shape)
    return torch.stack(rows).to(x_TD.dtype)


def _use_triton(x_TD: torch.Tensor, weights_TK: torch.Tensor, bank: ExpertBank) -> bool:
    """The Triton W4A16 path serves inference only: NVFP4 bank, bf16 tokens, no adapter, no grad."""
    needs_grad = torch.is_grad_enabled() and (x_TD.requires_grad or weights_TK.requires_grad)
    return (
        triton_available is not None
        and bank.fmt == "nvfp4"
        and bank.lora is None
        and not needs_grad
        and triton_available(x_TD)
        and triton_moe_supported(x_TD, bank.w1_weight, bank.w2_weight)
    )


def _stacked_lora(bank: ExpertBank) -> tuple | None:
    """(A1, B1, A3, B3, A2, B2, scaling) of an adapter that keeps its per-expert factors stacked
    (`model.layers.lora.ExpertLoRA`: `w1/w2/w3.lora_A` [E, R, in], `.lora_B` [E, out, R]) and whose
    dropout is inactive; None for any other hook (it then runs on the torch path)."""
    # A whole-layer adapter behind a partial bank (`OffsetExpertLoRA`): the kernels index the factors
    # by local expert id, so they get this bank's rows (views: gradients still reach the whole tensors).
    lo = getattr(bank.lora, "offset", 0)
    lora = getattr(bank.lora, "inner", bank.lora)
    try:
        factors = [getattr(getattr(lora, p), n) for p in ("w1", "w3", "w2") for n in ("lora_A", "lora_B")]
        if lo or any(f.shape[0] != bank.num_experts for f in factors):
            factors = [f[lo : lo + bank.num_experts] for f in factors]
        scaling = float(lora.scaling)
        dropout = lora.lora_dropout
    except AttributeError:
        return None
    if dropout.training and not isinstance(dropout, torch.nn.Identity):
        return None  # dropout masks are not implemented in the kernel
    if any(f.dim() != 3 for f in factors):
        return None
    return (*factors, scaling)


def _use_triton_train(x_TD: torch.Tensor, weights_TK: torch.Tensor, bank: ExpertBank) -> tuple | None:
    """The training kernels serve NVFP4 banks whenever a gradient is needed or an adapter is attached
    (also without grad: the decode kernel has no adapter path); bf16 tokens (fp32 too under the
    interpreter, for exact tests). Returns the LoRA argument of
    `moe_nvfp4_train` ((), meaning none, or the factors), or None to use another path."""
    needs_grad = torch.is_grad_enabled() and (x_TD.requires_grad or weights_TK.requires_grad)
    if not (
        triton_available is not None
        and (needs_grad or bank.lora is not None)
        and bank.fmt == "nvfp4"
        and triton_available(x_TD)
        and (x_TD.dtype == torch.bfloat16 or not x_TD.is_cuda)  # fp32 on a GPU: the exact torch path
        and triton_moe_train_supported(x_TD, bank.w1_weight, bank.w2_weight)
    ):
        return None
    if bank.lora is None:
        return ()
    return _stacked_lora(bank)


def moe_experts(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, bank: ExpertBank,
    *, shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Grouped execution of the routed experts: y_TD = sum_k topk_weights[t, k] * expert(x[t]), then
    `y_TD + shared(x_TD)` if given (the MoE block's shared expert, added after y's rounding).

    Differentiable w.r.t. x_TD and topk_weights_TK (and a float bank's weights if they require grad).
    The one dispatch point for this op, the shared term's included: on the engine path (the NVFP4
    kernel under `triton_inference_path`) it joins the routed combine launch; everywhere else it is
    evaluated after the routed experts, then added: evaluated first it reorders the autograd graph,
    so the order x's gradient contributions are summed in and the learner's fp32 bits (389f8c6).
    """
    _check_args(x_TD, topk_ids_TK, topk_weights_TK, bank)
    n_tokens, top_k = topk_ids_TK.shape
    if n_tokens == 0 or top_k == 0:
        y_TD = x_TD.new_zeros(x_TD.shape) + 0.0 * topk_weights_TK.sum()  # keeps the graph connected
    elif (train_lora := _use_triton_train(x_TD, topk_weights_TK, bank)) is not None:
        y_TD = moe_nvfp4_train(
            x_TD, topk_ids_TK, topk_weights_TK,
            *((getattr(bank, f"{p}_weight"), getattr(bank, f"{p}_weight_scale"),
               getattr(bank, f"{p}_weight_scale_2")) for p in ("w1", "w3", "w2")),
            train_lora or None, swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit,
        )  # fmt: skip
    elif _use_triton(x_TD, topk_weights_TK, bank):
        # The engine path (inference mode: no graph to reorder, no gradient the launch would drop;
        # eager) evaluates the shared expert first: the combine launch takes it where `y + shared`
        # keeps y's dtype and shape (no promotion, no broadcast): always, in a model of one dtype.
        shared_TD = shared(x_TD) if shared is not None and triton_inference_path(x_TD) else None
        fuse = shared_TD is not None and shared_TD.dtype == x_TD.dtype and shared_TD.shape == x_TD.shape
        y_TD = moe_nvfp4_triton(
            x_TD, topk_ids_TK, topk_weights_TK,
            *((getattr(bank, f"{p}_weight"), getattr(bank, f"{p}_weight_scale"),
               getattr(bank, f"{p}_weight_scale_2")) for p in ("w1", "w3", "w2")),
            swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit,
            shared_TD=shared_TD if fuse else None,
        )  # fmt: skip
        if shared_TD is not None:
            return y_TD if fuse else y_TD + shared_TD
    else:
        y_TD = moe_experts_torch(x_TD, topk_ids_TK, topk_weights_TK, bank)
    return y_TD if shared is None else y_TD + shared(x_TD)


def moe_experts_torch(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, bank: ExpertBank
) -> torch.Tensor:
    """Torch grouped path (training, CPU, non-NVFP4 banks): slots sorted by expert, one call per
    active expert. Differentiable; one host sync for the group bounds."""
    if is_static_shapes():
        return _moe_experts_every_expert(x_TD, topk_ids_TK, topk_weights_TK, bank)
    top_k = topk_ids_TK.shape[1]
    ids_S = topk_ids_TK.reshape(-1)
    order_S = torch.argsort(ids_S, stable=True)  # slots grouped by expert, token order kept inside a group
    token_S = order_S // top_k
    counts_E = torch.bincount(ids_S, minlength=bank.num_experts)
    # SYNC: the Python loop over experts needs each group's bounds on the host (one copy of E ints/call).
    ends = counts_E.cumsum(0).tolist()
    if len(ends) > bank.num_experts:
        raise ValueError(f"moe_experts: topk_ids hold expert ids >= num_experts = {bank.num_experts}")
    x_SD = x_TD[token_S]
    outs = []
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            outs.append(_expert_mlp(bank, e, x_SD[start:end]))
        start = end
    y_SD = torch.cat(outs)
    weights_S = topk_weights_TK.reshape(-1)[order_S]
    contrib_SD = y_SD.float() * weights_S.float().unsqueeze(1)
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device).index_add(0, token_S, contrib_SD)
    return y_TD.to(x_TD.dtype)


def _moe_experts_every_expert(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, bank: ExpertBank
) -> torch.Tensor:
    """The torch path under `static_shapes()` (padded decode, graph capture on a float / fp32 path): every
    expert runs on every token and is weighted by the token's router weight for it (0 if not chosen):
    fixed shapes, no host sync, E x the grouped path's FLOPs (small models and tests). fp32 sums."""
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(bank.num_experts):
        w_T = torch.where(topk_ids_TK == e, topk_weights_TK.float(), 0.0).sum(-1)
        y_TD = y_TD + w_T[:, None] * _expert_mlp(bank, e, x_TD).float()
    return y_TD.to(x_TD.dtype)
