"""rl/workers.py: the vLLM settings a rollout worker builds from the run's config."""

from __future__ import annotations

import dataclasses

from rl.config import load_config
from rl.workers import vllm_settings
from rollout.vllm_backend import VLLMSettings

VLLM = [
    "rollout.backend=vllm", "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.5",
    "rollout.max_model_len=512", "rollout.max_num_seqs=7", "rollout.vllm_sync=ramdir",
    "rollout.vllm_dtype=bf16", "rollout.kv_cache_dtype=fp8", "lora.r=16", "lora.alpha=24",
    "lora.dropout=0.05", "trainer.seed=5", "rollout.kv_cache_memory_bytes=1048576",
]  # fmt: skip


def test_vllm_settings_take_every_rollout_and_lora_key_that_names_a_field():
    cfg = load_config("quickstart", VLLM)
    s = vllm_settings(cfg, "/base", ("self_attn.q_proj",), index=2, eos_token_id=3)
    assert (s.tensor_parallel_size, s.gpu_memory_utilization, s.max_model_len, s.max_num_seqs) == (
        2,
        0.5,
        512,
        7,
    )
    assert (s.sync, s.dtype, s.kv_cache_dtype) == ("ramdir", "bfloat16", "fp8")
    assert s.kv_cache_memory_bytes == 1 << 20
    assert (s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets) == (16, 24.0, 0.05, ("self_attn.q_proj",))
    assert (s.model, s.seed, s.eos_token_id, s.drafter, s.max_lora_rank) == ("/base", 7, 3, None, 32)
    # Every section key spelled like a settings field (directly or as vllm_<field> / lora_<field>) arrives.
    fields = {f.name for f in dataclasses.fields(VLLMSettings)}
    shared = [f.name for f in dataclasses.fields(cfg.rollout) if f.name.removeprefix("vllm_") in fields]
    assert sorted(shared) == sorted(
        ["kv_cache_dtype", "max_num_seqs", "tensor_parallel_size", "gpu_memory_utilization", "vllm_sync",
         "vllm_dtype", "max_model_len", "kv_cache_memory_bytes"]
    )  # fmt: skip


def test_vllm_settings_defaults_follow_the_model():
    cfg = load_config("quickstart", ["rollout.backend=vllm", "rollout.kv_cache_dtype=null"])
    s = vllm_settings(cfg, "/base", ("q_proj",), index=0, eos_token_id=None)
    assert (s.dtype, s.kv_cache_dtype) == ("float32", "auto")  # model.dtype=fp32; unquantized cache
    fp32_cache = load_config("quickstart", ["rollout.backend=vllm", "rollout.kv_cache_dtype=fp32"])
    assert vllm_settings(fp32_cache, "/base", ("q_proj",), 0, None).kv_cache_dtype == "auto"
