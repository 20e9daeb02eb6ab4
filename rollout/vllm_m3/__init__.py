"""vLLM plugin: the MiniMax-M3 family served with LoRA, and the project's checkpoint layouts.

What: `register()` (entry point `nvfp4_rl_m3` of group `vllm.general_plugins`, run by vLLM in every
process it starts) registers, once per process:
- the `minimax_m3_vl_text` config class (config.py), so vLLM parses the flat text configs the
  project writes for float checkpoints (model/hf_config.py) as it parses `minimax_m3_vl`;
- `MiniMaxM3SparseForCausalLM` -> `MiniMaxM3LoRAForCausalLM` (model.py): vLLM's own M3 model plus
  `SupportsLoRA`, the port's tensor names, and CPU fallbacks for its CUDA-only ops;
- the LoRA layers of the five-slice q|k|v|index_q|index_k projection (lora.py) in vLLM's list.
`ensure_discoverable()` makes the entry point visible to vLLM's child processes when the package runs
from a source tree whose installed metadata predates it.
Why: vLLM 0.32's M3 has no LoRA, and a skipped fused projection would drop the q/k/v deltas silently.
Invariants: `register()` is idempotent and imports no CUDA code (the model class is registered lazily).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

log = logging.getLogger(__name__)

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "nvfp4_rl_m3"
PLUGIN_TARGET = "rollout.vllm_m3:register"
MODEL_CLASS = "rollout.vllm_m3.model:MiniMaxM3LoRAForCausalLM"
ARCHITECTURE = "MiniMaxM3SparseForCausalLM"

_registered = False


def register() -> None:
    """vLLM's plugin hook (see the module docstring); safe to call any number of times."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_config

    from rollout.vllm_m3.config import MiniMaxM3TextConfigForVLLM
    from rollout.vllm_m3.lora import register_lora_layers

    # vLLM has no public hook for a config class; its registry is the dict get_config consults.
    vllm_config._CONFIG_REGISTRY[MiniMaxM3TextConfigForVLLM.model_type] = MiniMaxM3TextConfigForVLLM
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    register_lora_layers()
    _registered = True


def entry_point_installed() -> bool:
    return any(
        ep.name == PLUGIN_NAME and ep.value == PLUGIN_TARGET for ep in entry_points(group=PLUGIN_GROUP)
    )


def ensure_discoverable() -> None:
    """Make vLLM's processes (engine core, workers, the registry's inspection subprocess) load this
    plugin: if the installed package metadata lacks the entry point (a source tree used without
    reinstalling after pyproject.toml gained it), write a minimal dist-info naming it to a private
    directory and put that on PYTHONPATH (inherited by children) and sys.path. Then register here."""
    if not entry_point_installed():
        root = Path(tempfile.gettempdir()) / f"nvfp4-rl-vllm-plugin-{os.getuid()}"
        info = root / "nvfp4_rl_vllm_m3-0.0.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvfp4-rl-vllm-m3\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        here = str(Path(__file__).resolve().parents[2])  # the source tree, for spawned children
        for p in (here, str(root)):
            if p not in parts:
                parts.insert(0, p)
            if p not in sys.path:
                sys.path.insert(0, p)
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
        log.info("vLLM plugin %s: entry point provided through %s (reinstall the package to drop it)",
                 PLUGIN_NAME, root)  # fmt: skip
    register()
