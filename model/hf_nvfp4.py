"""NVFP4 frozen base + PEFT LoRA for any Hugging Face causal LM (Qwen3, Llama, ...).

What: `quantize_hf_model` swaps a transformers model's nn.Linear for `NVFP4Linear` (`model.nvfp4`,
ModelOpt-named buffers), `apply_peft_lora` / `load_peft_lora` put PEFT LoRA on top (custom-module
mapping `NVFP4Linear` -> `NVFP4LoraLinear`), `export_dequantized_base` writes the "dequantized twin"
(an ordinary HF checkpoint holding dequantize(quantize(W))) that vLLM's CPU build can serve. Why:
small public models make the frozen-NVFP4-base path testable and servable without the M3 code.

Invariants: one quantizer (`state_dict()` is the ModelOpt layout, hashed by `base_fingerprint`); the
base is frozen and never materialised whole in full precision; `model.to(dtype)` never casts the NVFP4
buffers; a fresh adapter leaves outputs bit-identical; the twin's weights are bit for bit what
`nvfp4_linear` multiplies by in the exported dtype; adapter files are plain PEFT.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from model.checkpoint import base_fingerprint
from model.kernels.nvfp4_linear import nvfp4_linear
from model.nvfp4 import BLOCK_SIZE, NVFP4Tensor, dequantize, quantize

# Shapes: N output features, K input features (multiple of 16), R rank.
# Buffers: `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` fp32;
# quantized weights are buffers (no grad possible) and every other base parameter has
# requires_grad=False; forward and backward go through `model.kernels.nvfp4_linear.nvfp4_linear`
# tile by tile. The twin is exported in bf16 by default (fp32 for an fp32 learner); served outputs
# then differ only by matmul accumulation order. The custom PEFT mapping lives only in memory, so
# `PeftModel.from_pretrained` applies the adapter files to the twin unchanged.

log = logging.getLogger(__name__)

DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Attention projections: the default LoRA targets of a Hugging Face policy built without a recipe."""
SOURCE_FILE = "nvfp4_source.json"
"""Written beside the dequantized twin: which NVFP4 base (fingerprint, modules) it came from."""


# ------------------------------------------------------------------------------ the frozen layer
class NVFP4Linear(nn.Module):
    """y = x @ dequant(W).T (+ b), W held as NVFP4 buffers; differentiable w.r.t. x only."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if in_features % BLOCK_SIZE or in_features <= 0:
            raise ValueError(f"NVFP4Linear: in_features={in_features} must be a positive multiple of 16")
        self.in_features, self.out_features = in_features, out_features
        # Zero-filled placeholders of the right shape and dtype, so a ModelOpt state dict loads in.
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> NVFP4Linear:
        """Quantize `lin.weight` with `model.nvfp4.quantize` (default per-tensor global scale)."""
        q = quantize(lin.weight.detach())
        m = cls(lin.in_features, lin.out_features, bias=False, device="meta")
        m.weight, m.weight_scale, m.weight_scale_2 = q.packed, q.scales, q.scale_2.reshape(())
        if lin.bias is not None:
            m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        return m

    @property
    def nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(packed=self.weight, scales=self.weight_scale, scale_2=self.weight_scale_2)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole [N, K] weight in dtype (fp32 dequant, one cast): for export only, not training."""
        return dequantize(self.nvfp4, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nvfp4_linear(x, self.weight, self.weight_scale, self.weight_scale_2)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _apply(self, fn, recurse: bool = True):
        # nn.Module.to(dtype) casts every floating tensor: e4m3 scales and the fp32 scale_2 would be
        # re-rounded and the base would silently change. Move them (device only), cast the rest.
        scales = {k: self._buffers.pop(k) for k in ("weight_scale", "weight_scale_2")}
        try:
            super()._apply(fn, recurse)
        finally:
            for k, t in scales.items():
                moved = fn(t)
                self._buffers[k] = t.to(moved.device) if moved.dtype != t.dtype else moved
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


# ------------------------------------------------------------------------------ quantizing a model
def _matches(name: str, patterns: Sequence[str]) -> bool:
    """fnmatch on the full module name or on a dotted suffix: `q_proj`, `mlp.*`, `model.layers.0.*`."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in patterns)


def _skip_reason(
    name: str,
    lin: nn.Linear,
    include: Sequence[str] | None,
    exclude: Sequence[str],
    min_features: int,
    tied: set[int],
) -> str | None:
    if include is not None and not _matches(name, include):
        return "not in include"
    if _matches(name, exclude):
        return "excluded"
    if id(lin.weight) in tied:
        return "weight tied to the input embeddings (quantizing it would untie them)"
    if min(lin.in_features, lin.out_features) < min_features:
        return f"smaller than min_features={min_features} ({lin.out_features}x{lin.in_features})"
    if lin.in_features % BLOCK_SIZE:
        return f"in_features={lin.in_features} is not a multiple of {BLOCK_SIZE}"
    return None


def quantize_hf_model(
    model: nn.Module,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = ("lm_head",),
    min_features: int = 16,
) -> dict[str, Any]:
    """Replace the model's nn.Linear modules by `NVFP4Linear` in place and freeze the whole base.

    A linear is quantized when it matches `include` (all linears if None), matches no `exclude`
    pattern, is not tied to the input embeddings, has both dims >= `min_features` and K % 16 == 0.
    Returns {"quantized": [names], "skipped": {name: reason}, "num_quantized", "bytes_before",
    "bytes_after"} (bytes of the replaced weights only, before in their original dtype).
    """
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(
            "quantize_hf_model: the model already has PEFT adapters; quantize first, then apply_peft_lora"
        )
    if isinstance(include, str) or isinstance(exclude, str):
        raise TypeError("quantize_hf_model: include / exclude are sequences of patterns, not one string")
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    stats: dict[str, Any] = {"quantized": [], "skipped": {}, "bytes_before": 0, "bytes_after": 0}
    for name, lin in list(model.named_modules()):
        if type(lin) is not nn.Linear:
            continue
        reason = _skip_reason(name, lin, include, exclude, min_features, tied)
        if reason is not None:
            stats["skipped"][name] = reason
            continue
        q = NVFP4Linear.from_linear(lin)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, q)
        stats["quantized"].append(name)
        stats["bytes_before"] += lin.weight.nbytes
        stats["bytes_after"] += q.nvfp4.nbytes
    model.requires_grad_(False)
    stats["num_quantized"] = len(stats["quantized"])
    if not stats["quantized"]:
        raise ValueError(f"quantize_hf_model: no linear was quantized; skipped: {stats['skipped']}")
    log.info(
        "NVFP4: quantized %d linears (%.2f MB -> %.2f MB), skipped %s",
        stats["num_quantized"], stats["bytes_before"] / 1e6, stats["bytes_after"] / 1e6, stats["skipped"],
    )  # fmt: skip
    return stats


def _normalize(name: str) -> str:
    """PEFT-wrapped name -> the plain model's name (`base_model.model.` prefix, `.base_layer` dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".base_layer", "")


def hf_base_fingerprint(model: nn.Module) -> str:
    """`model.checkpoint.base_fingerprint` under the plain model's names, so the quantized model gives
    the same value before and after `apply_peft_lora` (adapter tensors are skipped as there)."""

    class _Renamed(nn.Module):  # base_fingerprint only reads named_parameters / named_buffers
        def named_parameters(self, *a, **k):
            return ((_normalize(n), t) for n, t in model.named_parameters())

        def named_buffers(self, *a, **k):
            return ((_normalize(n), t) for n, t in model.named_buffers())

    return base_fingerprint(_Renamed())


# ------------------------------------------------------------------------------ PEFT
class NVFP4LoraLinear(nn.Module, LoraLayer):
    """PEFT LoRA layer over an `NVFP4Linear`: base forward (NVFP4, frozen) + B(A(dropout(x))) * scaling.

    Registered through `LoraConfig._register_custom_module`; follows PEFT's layer conventions
    (`lora_A` / `lora_B` ModuleDicts keyed by adapter name), so PEFT saves, loads, enables and
    disables it like its own Linear. Merging is refused: the base is NVFP4 and shared bit for bit
    with the rollout engine; merge on the dequantized twin instead.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs) -> None:  # fmt: skip
        if config.lora_bias or config.use_dora or config.fan_in_fan_out:
            raise ValueError(
                "NVFP4LoraLinear supports plain LoRA only (no lora_bias, DoRA or fan_in_fan_out)"
            )
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # PEFT's generic lookup warns on unknown types

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is not None and not self.disable_adapters:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            x_lora = self._cast_input_dtype(x, lora_A.weight.dtype)
            result = result + lora_B(lora_A(self.lora_dropout[name](x_lora))) * self.scaling[name]
        return result.to(out_dtype)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """B @ A * scaling [N, K] in the adapter's dtype."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError(
            "NVFP4LoraLinear: the NVFP4 base is frozen and cannot absorb an adapter; export the "
            "dequantized twin (export_dequantized_base) and merge there, or serve the adapter as is"
        )

    def unmerge(self) -> None:
        self.merge()

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def peft_lora_config(
    r: int = 32,
    alpha: float = 64,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    dropout: float = 0.0,
) -> LoraConfig:
    """A plain PEFT LoraConfig (what adapter_config.json will say) with the NVFP4 mapping registered."""
    if isinstance(target_modules, str):
        raise TypeError(
            "target_modules: give a list of module names, not one string (PEFT would read a regex)"
        )
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    cfg._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return cfg


def apply_peft_lora(
    model: nn.Module,
    r: int = 32,
    alpha: float = 64,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    dropout: float = 0.0,
    *,
    base_model_name_or_path: str | None = None,
) -> PeftModel:
    """Wrap the (quantized) model with fresh PEFT LoRA adapters; only adapter tensors train.
    `base_model_name_or_path` (e.g. the Hub id the twin serves under) goes into adapter_config.json."""
    peft_model = get_peft_model(model, peft_lora_config(r, alpha, target_modules, dropout))
    if base_model_name_or_path is not None:
        peft_model.peft_config["default"].base_model_name_or_path = base_model_name_or_path
    return peft_model


def load_peft_lora(
    model: nn.Module, adapter_dir: str | os.PathLike, *, is_trainable: bool = False
) -> PeftModel:
    """`PeftModel.from_pretrained` for a quantized model: the saved config carries no custom-module
    mapping (it is not serialised), so it is registered again here before loading."""
    cfg = LoraConfig.from_pretrained(str(adapter_dir))
    cfg._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return PeftModel.from_pretrained(model, str(adapter_dir), config=cfg, is_trainable=is_trainable)


# ------------------------------------------------------------------------------ the dequantized twin
def dequantized_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base as an ordinary HF state dict in dtype: NVFP4 linears dequantized to `weight`,
    adapter tensors dropped, PEFT wrapper names undone."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    nvfp4 = {name: m for name, m in base.named_modules() if isinstance(m, NVFP4Linear)}
    out: dict[str, torch.Tensor] = {}
    for name, m in nvfp4.items():
        out[_normalize(name) + ".weight"] = m.dequantized_weight(dtype)
        if m.bias is not None:
            out[_normalize(name) + ".bias"] = m.bias.detach().to(dtype)
    for name, t in base.state_dict().items():
        module = name.rpartition(".")[0]
        if "lora_" in name or module in nvfp4:
            continue
        out[_normalize(name)] = t.detach().to(dtype) if t.is_floating_point() else t
    return out


def export_dequantized_base(
    model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the dequantized twin with `save_pretrained` (config, safetensors, generation config)
    plus `nvfp4_source.json` (the NVFP4 base's fingerprint and quantized modules). Its linears hold
    dequantize(quantize(W)) in dtype, the same values `nvfp4_linear` multiplies by when the
    activations are in dtype. Loadable by `AutoModelForCausalLM.from_pretrained` and vLLM."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    out_dir = Path(out_dir)
    state = dequantized_state_dict(base, dtype)
    config = copy.deepcopy(base.config)
    config.dtype = dtype
    with torch.device("meta"):  # the architecture only: weights come from `state`, assigned not copied
        twin = type(base)(config)
    twin.load_state_dict(state, strict=True, assign=True)
    twin.tie_weights()
    twin.save_pretrained(out_dir)
    source = {
        "nvfp4_base_fingerprint": hf_base_fingerprint(base),
        "dtype": str(dtype).removeprefix("torch."),
        "quantized_modules": sorted(
            _normalize(n) for n, m in base.named_modules() if isinstance(m, NVFP4Linear)
        ),
    }
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2))
    return out_dir
