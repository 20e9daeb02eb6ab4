"""The adapter a run ends with: `run_dir/adapter`, in PEFT format, servable by vLLM and
`rollout.serve` (exporting any adapter later, peft or merged, is `python -m rl.export`).

Why beside rl/export.py: this writes what the learners hold at the end of `fit`; rl/export.py
reads and converts adapters already on disk.

Invariants: the adapter records the base it was trained on (MiniMax-M3: fingerprint, config, dtype
and tokenizer in adapter_metadata.json; Hugging Face bases: `nvfp4_source.json`), so a mismatched
base is refused at load; the directory appears whole (written aside, then renamed) or not at all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from model.adapter import AdapterMetadata, peft_config_dict, save_adapter
from model.config import ModelConfig
from model.integrity import write_manifest
from rl.config import TrainConfig

_BASE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def export_run_adapter(
    cfg: TrainConfig,
    run_dir: Path,
    base_dir: Path,
    base_fingerprint: str,
    step: int,
    tensors: dict[str, torch.Tensor],
    metrics: dict[str, float] | None = None,
) -> Path:
    """Write the learners' adapter `tensors` (rl.sync AdapterUpdate.tensors) at `step` to
    `run_dir/adapter` with the run's final `metrics`; returns that directory."""
    scalars = {k: float(v) for k, v in (metrics or {}).items()}
    if cfg.model.family == "hf":
        return _export_hf(cfg, run_dir, base_fingerprint, step, tensors, scalars)
    meta = AdapterMetadata(
        base_fingerprint=base_fingerprint,
        base_config=ModelConfig.from_pretrained(base_dir).to_hf_dict(),
        base_dtype=_BASE_DTYPES[cfg.model.dtype],
        step=step,
        metrics=scalars,
        tokenizer=cfg.model.tokenizer,
    )
    out = run_dir / "adapter"
    save_adapter(None, out, cfg.lora, base_model_name_or_path=str(base_dir), metadata=meta, tensors=tensors)
    return out


def _export_hf(
    cfg: TrainConfig, run_dir: Path, fingerprint: str, step: int, tensors: dict, metrics: dict[str, float]
) -> Path:
    """Plain PEFT files for a Hugging Face base: `PeftModel.from_pretrained(twin, dir)` and vLLM
    (`--lora-modules`) load them; `nvfp4_source.json` names the NVFP4 base fingerprint. Target
    names are the Hugging Face model's own (`q_proj`), as the learner's PEFT model has them."""
    from safetensors.torch import save_file

    lc, out = cfg.lora, run_dir / "adapter"
    staging = out.with_name("adapter.tmp")
    staging.mkdir(parents=True, exist_ok=True)
    peft_cfg = peft_config_dict(lc.r, lc.alpha, lc.dropout, lc.target_modules, str(run_dir / "base_vllm"))
    (staging / "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "adapter_model.safetensors"))
    write_manifest(staging, ["adapter_model.safetensors"])
    source = {"nvfp4_base_fingerprint": fingerprint, "step": step, "metrics": metrics}
    (staging / "nvfp4_source.json").write_text(json.dumps(source, indent=2))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
