"""MiniMax-M3 feed-forward blocks: the dense SwiGLU-OAI MLP and the sparse MoE block.

What: `DenseMLP` (the dense prefix's `mlp` and every MoE layer's `shared_experts`), `ExpertBank` (the
E routed experts stacked, float / NVFP4 / MXFP8; tensor `{w}_{suffix}` stacks the checkpoint's
`experts.{e}.{w}.{suffix}`, an MXFP8 `weight_scale_inv` held as `weight_scale`; `ExpertBank.lora` is
the per-expert adapter hook) and `MoE` (`block_sparse_moe`: the router of docs/FACTS.md,
"M3 architecture", routed experts, shared expert always added).

Invariants: router weight and correction bias stay fp32, and quantized bank storage keeps its dtypes
through `module.to(dtype)` (only devices follow); quantized banks are buffers, never given gradients;
experts run through `model.kernels.moe.moe_experts` (one dispatch point); NVFP4 w1 and w3 of an expert
share one global scale (vLLM serves the fused w13 with w1's `weight_scale_2`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.kernels.inference_path import triton_inference_path
from model.kernels.moe import ExpertDelta, Proj, moe_experts, swigluoai
from model.mxfp8 import MXFP8_BLOCK, dequantize_mxfp8, quantize_mxfp8
from model.nvfp4 import NVFP4Tensor, dequantize, quantize, to_modelopt

# Legend: B batch, S sequence, T tokens, D hidden, F expert ffn dim, E experts, K top-k.

__all__ = ["DenseMLP", "ExpertBank", "ExpertDelta", "ExpertFormat", "MoE", "RouterStats", "swigluoai"]

ExpertFormat = Literal["float", "nvfp4", "mxfp8"]
PROJS: tuple[Proj, ...] = ("w1", "w2", "w3")
NVFP4_BLOCK = 16
MXFP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # M3 checkpoints, vLLM after loading


def _keep_dtypes_apply(module: nn.Module, fn, recurse: bool, names: Iterable[str]) -> nn.Module:
    """`nn.Module._apply` that lets the tensors `names` follow device moves but not dtype casts."""
    before = {}
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        t = owner._parameters.get(leaf, owner._buffers.get(leaf))
        if t is not None:
            before[name] = (owner, leaf, t.data)  # .data: the original storage, even if replaced below
    nn.Module._apply(module, fn, recurse)
    for owner, leaf, old in before.values():
        now = owner._parameters.get(leaf, owner._buffers.get(leaf))
        if now.dtype != old.dtype:
            if leaf in owner._parameters:
                now.data = old.to(device=now.device)
            else:
                owner._buffers[leaf] = old.to(device=now.device)
    return module


class DenseMLP(nn.Module):
    """down_proj(swigluoai(gate_proj(x), up_proj(x))): the dense MLP and the MoE shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_alpha = config.swiglu_alpha
        self.swiglu_limit = config.swiglu_limit

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        act_TF = swigluoai(self.gate_proj(x_TD), self.up_proj(x_TD), self.swiglu_alpha, self.swiglu_limit)
        return self.down_proj(act_TF)


def quantize_expert_nvfp4(
    w1_FD: torch.Tensor, w3_FD: torch.Tensor, w2_DF: torch.Tensor
) -> dict[Proj, NVFP4Tensor]:
    """One expert's float weights -> NVFP4, the way every path in the project does it (bank, convert).

    w1 and w3 share one global scale (max amax / 2688), as ModelOpt exports a fused gate/up: vLLM
    serves the fused w13 with w1's `weight_scale_2` only. Block scales are per row, so quantizing
    [w1; w3] at once and splitting the rows is exact.
    """
    f = w1_FD.shape[0]
    w13 = quantize(torch.cat([w1_FD, w3_FD]).float())
    return {
        "w1": NVFP4Tensor(packed=w13.packed[:f], scales=w13.scales[:f], scale_2=w13.scale_2),
        "w3": NVFP4Tensor(packed=w13.packed[f:], scales=w13.scales[f:], scale_2=w13.scale_2),
        "w2": quantize(w2_DF.float()),
    }


class ExpertBank(nn.Module):
    """E routed experts stacked: w1 (gate) [E, F, D], w3 (up) [E, F, D], w2 (down) [E, D, F].

    Storage per projection `w` (checkpoint suffix in the name):
      float: `w_weight` nn.Parameter [E, out, in] (frozen unless trainable=True);
      nvfp4: buffers `w_weight` uint8 [E, out, in/2], `w_weight_scale` float8_e4m3fn [E, out, in/16],
             `w_weight_scale_2` fp32 [E];
      mxfp8: buffers `w_weight` float8_e4m3fn [E, out, in], `w_weight_scale` uint8 E8M0 [E, out, in/32].
    `lora` is the per-expert adapter hook (an `ExpertDelta`, e.g. an nn.Module; None = no adapter).
    A bank may hold a contiguous range of a layer's experts (expert parallelism): local expert i is
    global expert `first_expert + i` of `total_experts`; a whole bank has first_expert 0 and
    total_experts == num_experts. `lora` hooks are always called with local expert ids.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        fmt: ExpertFormat = "float",
        *,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        trainable: bool = False,
        first_expert: int = 0,
        total_experts: int | None = None,
    ):
        super().__init__()
        total = num_experts if total_experts is None else total_experts
        if not 0 <= first_expert < first_expert + num_experts <= total:
            raise ValueError(
                f"ExpertBank: experts [{first_expert}, {first_expert + num_experts}) do not fit in "
                f"total_experts={total}"
            )
        if fmt not in ("float", "nvfp4", "mxfp8"):
            raise ValueError(f"ExpertBank: fmt must be 'float', 'nvfp4' or 'mxfp8', got {fmt!r}")
        block = {"nvfp4": NVFP4_BLOCK, "mxfp8": MXFP8_BLOCK}.get(fmt, 1)
        if hidden_size % block or intermediate_size % block:
            raise ValueError(
                f"ExpertBank: {fmt} needs hidden_size ({hidden_size}) and intermediate_size "
                f"({intermediate_size}) to be multiples of {block} (the K dims of w1/w3 and w2)"
            )
        if trainable and fmt != "float":
            raise ValueError(f"ExpertBank: a {fmt} bank is frozen storage; trainable=True needs fmt='float'")
        self.num_experts = num_experts
        self.first_expert, self.total_experts = first_expert, total
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.fmt: ExpertFormat = fmt
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.lora: ExpertDelta | None = None
        e = num_experts
        for proj, (n_out, n_in) in self.proj_shapes().items():
            if fmt == "float":
                w = torch.zeros(e, n_out, n_in, dtype=dtype, device=device)
                self.register_parameter(f"{proj}_weight", nn.Parameter(w, requires_grad=trainable))
            elif fmt == "nvfp4":
                self.register_buffer(
                    f"{proj}_weight", torch.zeros(e, n_out, n_in // 2, dtype=torch.uint8, device=device)
                )
                self.register_buffer(
                    f"{proj}_weight_scale",
                    torch.zeros(e, n_out, n_in // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=device),
                )
                self.register_buffer(
                    f"{proj}_weight_scale_2", torch.zeros(e, dtype=torch.float32, device=device)
                )
            else:
                self.register_buffer(
                    f"{proj}_weight", torch.zeros(e, n_out, n_in, dtype=torch.float8_e4m3fn, device=device)
                )
                self.register_buffer(
                    f"{proj}_weight_scale",
                    torch.zeros(e, n_out, n_in // MXFP8_BLOCK, dtype=torch.uint8, device=device),
                )

    def proj_shapes(self) -> dict[Proj, tuple[int, int]]:
        """(out, in) of each projection of one expert."""
        d, f = self.hidden_size, self.intermediate_size
        return {"w1": (f, d), "w2": (d, f), "w3": (f, d)}

    def _apply(self, fn, recurse=True):
        if self.fmt == "float":  # float banks follow the model's dtype
            return super()._apply(fn, recurse)
        return _keep_dtypes_apply(self, fn, recurse, [n for n, _ in self.named_buffers(recurse=False)])

    def num_quantized_values(self) -> int:
        """Logical weight values held in quantized buffers (0 for a float bank: those are parameters)."""
        return 0 if self.fmt == "float" else 3 * self.num_experts * self.hidden_size * self.intermediate_size

    @property
    def is_partial(self) -> bool:
        """True when the bank holds only some of its layer's experts (an expert-parallel shard)."""
        return self.num_experts != self.total_experts

    def extra_repr(self) -> str:
        part = (
            f", experts=[{self.first_expert}, {self.first_expert + self.num_experts}) of {self.total_experts}"
            if self.is_partial
            else ""
        )
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, fmt={self.fmt}{part}"
        )

    # ------------------------------------------------------------------ building and loading
    @classmethod
    def from_float(
        cls,
        w1_EFD: torch.Tensor,
        w3_EFD: torch.Tensor,
        w2_EDF: torch.Tensor,
        fmt: ExpertFormat,
        *,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        trainable: bool = False,
    ) -> ExpertBank:
        """A bank holding these weights in `fmt` (quantized with `model.nvfp4` / `model.mxfp8`)."""
        if w1_EFD.dim() != 3 or w3_EFD.shape != w1_EFD.shape:
            raise ValueError(
                f"from_float: w1 and w3 must both be [E, F, D], "
                f"got {tuple(w1_EFD.shape)}, {tuple(w3_EFD.shape)}"
            )
        e, f, d = w1_EFD.shape
        if tuple(w2_EDF.shape) != (e, d, f):
            raise ValueError(f"from_float: w2 must be [E, D, F] = {(e, d, f)}, got {tuple(w2_EDF.shape)}")
        bank = cls(
            e, d, f, fmt, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
            dtype=w1_EFD.dtype, device=w1_EFD.device, trainable=trainable,
        )  # fmt: skip
        for i in range(e):
            bank.quantize_expert_(i, w1_EFD[i], w3_EFD[i], w2_EDF[i])
        return bank

    @classmethod
    def empty_shard(
        cls, bank: ExpertBank, lo: int, hi: int, device: torch.device | str = "meta"
    ) -> ExpertBank:
        """An uninitialised bank for experts [lo, hi) of whole `bank`'s layer: same format, widths and
        activation (for loaders and random initialisers that fill only a rank's experts)."""
        ref = bank.w1_weight
        return cls(
            hi - lo, bank.hidden_size, bank.intermediate_size, bank.fmt,
            swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit,
            dtype=ref.dtype if bank.fmt == "float" else None, device=device,
            trainable=bank.fmt == "float" and ref.requires_grad,
            first_expert=lo, total_experts=bank.total_experts,
        )  # fmt: skip

    @torch.no_grad()
    def quantize_expert_(self, e: int, w1_FD: torch.Tensor, w3_FD: torch.Tensor, w2_DF: torch.Tensor) -> None:
        """Store expert `e` from float weights, quantizing to the bank's format (bf16 -> NVFP4 conversion)."""
        given = {"w1": w1_FD, "w3": w3_FD, "w2": w2_DF}
        for proj, shape in self.proj_shapes().items():
            if tuple(given[proj].shape) != shape:
                raise ValueError(f"quantize_expert_: {proj} must be {shape}, got {tuple(given[proj].shape)}")
        if self.fmt == "float":
            for proj, w in given.items():
                getattr(self, f"{proj}_weight")[e].copy_(w)
        elif self.fmt == "nvfp4":
            parts = quantize_expert_nvfp4(w1_FD, w3_FD, w2_DF)
            for proj, t in parts.items():
                self._store_nvfp4(proj, e, t)
        else:
            for proj, w in given.items():
                values, scales = quantize_mxfp8(w)
                getattr(self, f"{proj}_weight")[e].copy_(values)
                getattr(self, f"{proj}_weight_scale")[e].copy_(scales)

    @torch.no_grad()
    def init_normal_(self, std: float = 0.02, generator: torch.Generator | None = None) -> ExpertBank:
        """Random N(0, std^2) experts in the bank's format, one expert at a time (tests, tiny models).
        Drawn on the CPU (where `generator` lives) and moved, so the bank's device does not change
        the weights."""
        device = self.w1_weight.device
        for e in range(self.num_experts):
            w = {
                proj: (torch.randn(shape, generator=generator) * std).to(device)
                for proj, shape in self.proj_shapes().items()
            }
            self.quantize_expert_(e, w["w1"], w["w3"], w["w2"])
        return self

    def _store_nvfp4(self, proj: Proj, e: int, t: NVFP4Tensor) -> None:
        getattr(self, f"{proj}_weight")[e].copy_(t.packed)
        getattr(self, f"{proj}_weight_scale")[e].copy_(t.scales)
        getattr(self, f"{proj}_weight_scale_2")[e].copy_(t.scale_2.reshape(()))

    def expert_state(self, e: int, *, mxfp8_scale_name: str = "weight_scale_inv") -> dict[str, torch.Tensor]:
        """Expert `e` under checkpoint names relative to `experts.{e}.` (`w1.weight`, ...)."""
        out: dict[str, torch.Tensor] = {}
        for proj in PROJS:
            w = getattr(self, f"{proj}_weight")[e]
            if self.fmt == "float":
                out[f"{proj}.weight"] = w.detach()
            elif self.fmt == "nvfp4":
                t = NVFP4Tensor(
                    packed=w,
                    scales=getattr(self, f"{proj}_weight_scale")[e],
                    scale_2=getattr(self, f"{proj}_weight_scale_2")[e],
                )
                out.update(to_modelopt(f"{proj}.", t))
            else:
                if mxfp8_scale_name not in MXFP8_SCALE_NAMES:
                    raise ValueError(
                        f"mxfp8_scale_name must be one of {MXFP8_SCALE_NAMES}, got {mxfp8_scale_name!r}"
                    )
                out[f"{proj}.weight"] = w
                out[f"{proj}.{mxfp8_scale_name}"] = getattr(self, f"{proj}_weight_scale")[e]
        return out

    @torch.no_grad()
    def load_expert_state(self, e: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors of expert `e` (names relative to `experts.{e}.`) into the bank.

        Each projection present must be complete in one storage format, told by its `weight` dtype:
        uint8 = NVFP4, float8_e4m3fn = MXFP8 (scale `weight_scale_inv` or `weight_scale`), a float
        dtype = unquantized. In the bank's own format a subset of projections may come per call (shards
        may split an expert) and is copied verbatim. In another format the expert is converted
        (dequantized to fp32, then `quantize_expert_`), which needs w1, w2 and w3 in one call because
        NVFP4 w1/w3 share a global scale.
        """
        if not 0 <= e < self.num_experts:
            raise IndexError(f"load_expert_state: expert {e} out of range [0, {self.num_experts})")
        unknown = sorted(k for k in tensors if k.partition(".")[0] not in PROJS)
        if unknown:
            raise KeyError(f"load_expert_state: unexpected keys {unknown}; expected w1.*, w2.*, w3.*")
        parsed: dict[Proj, tuple[ExpertFormat, dict[str, torch.Tensor]]] = {}
        for proj in PROJS:
            mine = {k.partition(".")[2]: v for k, v in tensors.items() if k.startswith(f"{proj}.")}
            if mine:
                parsed[proj] = self._parse_proj(e, proj, mine)
        if all(fmt == self.fmt for fmt, _ in parsed.values()):
            for proj, (_, parts) in parsed.items():
                for suffix, src in parts.items():
                    self._copy_checked(f"{proj}_{suffix}", e, src, f"{proj}.{suffix}")
            return
        if set(parsed) != set(PROJS):
            raise KeyError(
                f"load_expert_state: converting expert {e} from {sorted({f for f, _ in parsed.values()})} "
                f"to this {self.fmt} bank needs w1, w2 and w3 in one call, got {sorted(parsed)}"
            )
        w = {proj: self._parts_to_float(fmt, parts) for proj, (fmt, parts) in parsed.items()}
        self.quantize_expert_(e, w["w1"], w["w3"], w["w2"])

    @staticmethod
    def _parse_proj(e: int, proj: Proj, mine: dict[str, torch.Tensor]) -> tuple[ExpertFormat, dict]:
        """Checkpoint suffixes of one projection -> (its format, tensors under the bank's suffixes)."""
        weight = mine.get("weight")
        if weight is None:
            raise KeyError(f"load_expert_state: expert {e} {proj} has {sorted(mine)} but no 'weight'")
        if weight.dtype == torch.uint8:
            fmt: ExpertFormat = "nvfp4"
            want = {"weight", "weight_scale", "weight_scale_2"}
            parts = {k: mine.get(k) for k in ("weight", "weight_scale", "weight_scale_2")}
        elif weight.dtype == torch.float8_e4m3fn:
            fmt = "mxfp8"
            names = [n for n in MXFP8_SCALE_NAMES if n in mine]
            want = {"weight", names[0] if names else MXFP8_SCALE_NAMES[0]}
            parts = {"weight": weight, "weight_scale": mine.get(names[0]) if names else None}
        elif weight.is_floating_point():
            fmt, want, parts = "float", {"weight"}, {"weight": weight}
        else:
            raise ValueError(
                f"load_expert_state: expert {e} {proj}.weight has unsupported dtype {weight.dtype}"
            )
        if set(mine) != want:
            hint = (
                " (W4A4 activation scales are not supported: the bank is weight-only)"
                if any(k == "input_scale" for k in mine)
                else ""
            )
            raise KeyError(
                f"load_expert_state: expert {e} {proj} in {fmt} needs exactly {sorted(want)}, "
                f"got {sorted(mine)}{hint}"
            )
        scale_dtypes = {"nvfp4": (torch.float8_e4m3fn, torch.float32), "mxfp8": (torch.uint8,)}.get(fmt, ())
        for (suffix, t), dtype in zip(list(parts.items())[1:], scale_dtypes):
            if t.dtype != dtype:
                raise ValueError(
                    f"load_expert_state: expert {e} {proj}.{suffix} is {t.dtype}, expected {dtype} for {fmt}"
                )
        if fmt == "nvfp4":
            if parts["weight_scale_2"].numel() != 1:
                raise ValueError(
                    f"load_expert_state: expert {e} {proj}.weight_scale_2 must hold one value, "
                    f"got shape {tuple(parts['weight_scale_2'].shape)}"
                )
            parts["weight_scale_2"] = parts["weight_scale_2"].reshape(())
        return fmt, parts

    @staticmethod
    def _parts_to_float(fmt: ExpertFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        if fmt == "nvfp4":
            t = NVFP4Tensor(parts["weight"], parts["weight_scale"], parts["weight_scale_2"].float())
            return dequantize(t, torch.float32)
        if fmt == "mxfp8":
            return dequantize_mxfp8(parts["weight"], parts["weight_scale"], torch.float32)
        return parts["weight"].float()

    def _copy_checked(self, attr: str, e: int, src: torch.Tensor, key: str) -> None:
        """Copy into slot e of `attr`; quantized storage must match shape and dtype, float weights shape."""
        dst = getattr(self, attr)[e]
        if tuple(src.shape) != tuple(dst.shape) or (self.fmt != "float" and src.dtype != dst.dtype):
            want = dst.dtype if self.fmt != "float" else "a float dtype"
            raise ValueError(
                f"load_expert_state: {key} is {src.dtype} {tuple(src.shape)}, "
                f"expected {want} {tuple(dst.shape)} (bank: {self.extra_repr()})"
            )
        dst.copy_(src)

    def dequantized(self, e: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """(w1 [F, D], w3 [F, D], w2 [D, F]) of expert `e` in `dtype`: the weights experts compute with."""
        out = []
        for proj in ("w1", "w3", "w2"):
            w = getattr(self, f"{proj}_weight")[e]
            if self.fmt == "nvfp4":
                t = NVFP4Tensor(
                    packed=w,
                    scales=getattr(self, f"{proj}_weight_scale")[e],
                    scale_2=getattr(self, f"{proj}_weight_scale_2")[e],
                )
                # fp32 first, one rounding to dtype: the same values nvfp4_linear computes with.
                out.append(dequantize(t, torch.float32).to(dtype))
            elif self.fmt == "mxfp8":
                out.append(dequantize_mxfp8(w, getattr(self, f"{proj}_weight_scale")[e], dtype))
            else:
                out.append(w.to(dtype))
        return tuple(out)

    def dequantized_all(
        self, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1_EFD, w3_EFD, w2_EDF) for all experts: `from_float(*bank.dequantized_all(), 'float')`."""
        per_expert = [self.dequantized(e, dtype) for e in range(self.num_experts)]
        return tuple(torch.stack([p[i] for p in per_expert]) for i in range(3))  # type: ignore[return-value]


@dataclass
class RouterStats:
    """Per-call routing statistics for logging (device tensors: reading them is the caller's sync)."""

    tokens_per_expert_E: torch.Tensor  # int64 [E], token-slots routed to each expert
    router_logits_TE: torch.Tensor  # fp32 [T, E], e.g. for a load-balancing or z-loss


def expert_format(scheme: str) -> ExpertFormat:
    """QuantConfig.routed_experts -> the bank storage format."""
    formats = {"bf16": "float", "nvfp4": "nvfp4", "mxfp8": "mxfp8"}
    if scheme not in formats:
        raise ValueError(
            f"quantization.routed_experts={scheme!r} is not supported for routed experts; use 'bf16', "
            f"'mxfp8' or 'nvfp4'"
        )
    return formats[scheme]  # type: ignore[return-value]


def select_experts_ref(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of docs/FACTS.md in torch: (ids [T, K] of the top-k sigmoid(logits) + bias, the
    chosen sigmoid scores normalised to sum to `scale`)."""
    scores_TE = torch.sigmoid(logits_TE)
    # The bias only steers which experts are chosen (load balancing); it never weights them.
    _, topk_ids_TK = torch.topk(scores_TE + bias_E, top_k, dim=-1)
    weights_TK = scores_TE.gather(1, topk_ids_TK)
    return topk_ids_TK, weights_TK / weights_TK.sum(dim=-1, keepdim=True) * scale


def select_experts(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (topk_ids_TK int64, topk_weights_TK fp32): `select_experts_ref`,
    in inference mode one Triton launch (`model.kernels.triton_router`) where Triton runs. Experts
    with equal biased scores: the Triton kernel takes the lower id first; torch.topk leaves ties
    unspecified (its CUDA kernel selects the same set in another order, its CPU kernel any of them)."""
    if triton_inference_path(logits_TE):
        from model.kernels.triton_router import router_topk_supported, router_topk_triton

        if router_topk_supported(logits_TE, top_k):
            return router_topk_triton(logits_TE, bias_E, top_k, scale)
    return select_experts_ref(logits_TE, bias_E, top_k, scale)


class MoE(nn.Module):
    """The `block_sparse_moe` module: router (`gate`, `e_score_correction_bias`), `experts`,
    `shared_experts` (None when shared_intermediate_size is 0)."""

    def __init__(self, config: ModelConfig, *, fmt: ExpertFormat | None = None):
        super().__init__()
        d, e = config.hidden_size, config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = nn.Linear(d, e, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = ExpertBank(
            e, d, config.moe_intermediate_size, fmt or expert_format(config.quantization.routed_experts),
            swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
        )  # fmt: skip
        self.shared_experts = (
            DenseMLP(d, config.shared_intermediate_size, config)
            if config.shared_intermediate_size > 0
            else None
        )

    def _apply(self, fn, recurse=True):
        # The router runs in fp32 (docs/FACTS.md, "M3 architecture") even when the rest of the
        # model is cast to bf16.
        return _keep_dtypes_apply(self, fn, recurse, ["gate.weight", "e_score_correction_bias"])

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (topk_ids_TK int64, topk_weights_TK fp32 summing to routed_scaling_factor, logits_TE fp32)."""
        # The cast is its own launch: cuBLAS has no bf16 x fp32 GEMM, and the router runs in fp32.
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        topk_ids_TK, weights_TK = select_experts(
            logits_TE, self.e_score_correction_bias.float(), self.top_k, self.routed_scaling_factor
        )
        return topk_ids_TK, weights_TK, logits_TE

    def _check_whole_bank(self) -> None:
        if self.experts.is_partial:
            raise RuntimeError(
                f"MoE: this block holds only a shard of its experts ({self.experts.extra_repr()}), "
                "e.g. from load_model(..., expert_range=...); wrap the model with "
                "model.parallel.expert_parallel.apply_expert_parallel over the expert-parallel group"
            )

    def _experts(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor):
        # moe_experts decides where the shared expert's output goes (the combine launch, or added after).
        return moe_experts(x_TD, topk_ids_TK, topk_weights_TK, self.experts, shared=self.shared_experts)

    def forward_with_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x [..., D] -> (out [..., D], RouterStats)."""
        self._check_whole_bank()
        x_TD = x.reshape(-1, x.shape[-1])
        topk_ids_TK, topk_weights_TK, logits_TE = self.route(x_TD)
        out_TD = self._experts(x_TD, topk_ids_TK, topk_weights_TK)
        stats = RouterStats(
            tokens_per_expert_E=torch.bincount(topk_ids_TK.reshape(-1), minlength=self.experts.num_experts),
            router_logits_TE=logits_TE,
        )
        return out_TD.reshape(x.shape), stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (e.g. [B, S, D]) -> [..., D]: `forward_with_stats` without the statistics (its
        CUDA bincount reads the largest id on the host: two syncs per layer per step, no capture)."""
        self._check_whole_bank()
        x_TD = x.reshape(-1, x.shape[-1])
        topk_ids_TK, topk_weights_TK, _ = self.route(x_TD)
        return self._experts(x_TD, topk_ids_TK, topk_weights_TK).reshape(x.shape)
