"""Capacity planner: parameter counts, checkpoint and cache bytes against the published figures,
deployment arithmetic, and the CLI."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.capacity import (
    Deployment,
    TensorSpec,
    checkpoint_bytes,
    index_cache_bytes_per_token,
    kv_bytes_per_token,
    num_parameters,
    plan,
)
from model.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
DEP4_256K = Deployment(gpus=4, gpu_memory_gb=288, parallel="dep", context_tokens=256 * 1024)


def test_full_m3_parameter_counts_match_published_totals():
    m3 = ModelConfig.preset("m3")
    assert 426e9 <= num_parameters(m3) <= 428e9
    assert 22.5e9 <= num_parameters(m3, active=True) <= 24e9
    # experts alone: 57 layers x 128 x 3 x 6144 x 3072
    assert plan(m3, DEP4_256K)["groups"]["routed_experts"]["params"] == 57 * 128 * 3 * 6144 * 3072


def test_tiny_parameter_count_matches_hand_formula():
    c = ModelConfig.preset("tiny")
    D, V, C, H, N = 128, 512, 32, 4, 2
    attn = 2 * D * H * C + 2 * D * N * C + 2 * C + 2 * D  # q,o + k,v + q/k norms + 2 layer norms
    indexer = D * N * C + D * C + 2 * C
    dense = 3 * D * 256
    moe = 8 * 3 * D * 64 + 3 * D * 64 + 8 * D  # routed + shared + router (bias is a buffer)
    want = 2 * V * D + D + 4 * attn + 3 * indexer + dense + 3 * moe
    assert num_parameters(c) == want
    active = 4 * attn + 3 * indexer + dense + 3 * (2 * 3 * D * 64 + 3 * D * 64 + 8 * D) + D
    assert num_parameters(c, active=True) == active


@pytest.mark.parametrize("preset, published", [("m3", 451.5e9), ("m3.1-flash", 250.1e9)])
def test_checkpoint_bytes_within_two_percent_of_published(preset, published):
    got = checkpoint_bytes(ModelConfig.preset(preset))
    assert abs(got / published - 1) < 0.02, got


def test_flash_checkpoint_about_45_percent_smaller_than_m3():
    saving = 1 - checkpoint_bytes(ModelConfig.preset("m3.1-flash")) / checkpoint_bytes(
        ModelConfig.preset("m3")
    )
    assert abs(saving - 0.446) < 0.02


def test_tensor_bytes_per_scheme():
    assert TensorSpec("w", "attention", 16, 64, "bf16").nbytes() == 2048
    assert TensorSpec("w", "attention", 16, 64, "fp8").nbytes() == 1024 + 8
    assert TensorSpec("w", "attention", 16, 64, "mxfp8").nbytes() == 1024 + 16 * 2
    assert TensorSpec("w", "attention", 16, 64, "nvfp4").nbytes() == 512 + 64 + 4
    assert TensorSpec("w", "attention", 16, 64, "nvfp4", copies=3).nbytes(w4a4=True) == 3 * (512 + 64 + 8)


def test_kv_bytes_per_token_match_published_figures():
    m3, fl = ModelConfig.preset("m3"), ModelConfig.preset("m3.1-flash")
    assert kv_bytes_per_token(m3) == 61_440 == 60 * 2 * 4 * 128
    assert kv_bytes_per_token(fl) == 34_560 == 60 * 2 * 4 * 72
    assert kv_bytes_per_token(dataclasses.replace(m3, kv_cache_dtype="bf16")) == 122_880
    assert abs(1 - 34_560 / 61_440 - 0.4375) < 1e-12
    # keeping the dense prefix in bf16 (per-layer override): 57 NVFP4 layers + 3 bf16 layers
    keep = dataclasses.replace(fl, kv_cache_dtype_overrides={0: "bf16", 1: "bf16", 2: "bf16"})
    assert kv_bytes_per_token(keep) == 57 * 2 * 4 * 72 + 3 * 2 * 4 * 256


def test_index_cache_bytes_per_token_per_dtype():
    m3 = ModelConfig.preset("m3")
    got = {d: index_cache_bytes_per_token(m3, d) for d in ("bf16", "fp8", "nvfp4", "none")}
    assert got == {"bf16": 57 * 256, "fp8": 57 * 128, "nvfp4": 57 * 72, "none": 0}
    assert index_cache_bytes_per_token(m3) == 57 * 256  # bf16 by default, as upstream


def test_nvfp4_kv_holds_at_least_177x_fp8_tokens_in_same_memory():
    fl = ModelConfig.preset("m3.1-flash")
    toks = {
        kv: plan(fl, DEP4_256K, kv_dtype=kv, index_cache_dtype="none")["max_cached_tokens"]
        for kv in ("fp8", "nvfp4")
    }
    assert toks["nvfp4"] >= 1.77 * toks["fp8"] > 0


def test_facts_serving_question_dep4_256k_flash_fits_more_sequences():
    m3 = plan(ModelConfig.preset("m3"), DEP4_256K)
    fl = plan(ModelConfig.preset("m3.1-flash"), DEP4_256K)
    n_m3, n_fl = m3["max_concurrent_sequences"], fl["max_concurrent_sequences"]
    print(
        f"\nDEP4 x 288 GB, 256K, bf16 index cache: M3 (FP8 KV) {n_m3}, M3.1-Flash (NVFP4 KV) {n_fl} sequences"
    )
    assert 0 < m3["max_concurrent_sequences"] < fl["max_concurrent_sequences"]
    assert m3["max_concurrent_sequences"] % 4 == 0  # four independent data-parallel KV pools


def test_deployment_weight_placement():
    m3 = ModelConfig.preset("m3")
    total = checkpoint_bytes(m3)
    experts = plan(m3, DEP4_256K)["groups"]["routed_experts"]["bytes"]
    one = Deployment(gpus=1, gpu_memory_gb=2000, parallel="tp", context_tokens=1024)
    assert plan(m3, one)["weights_bytes_per_gpu"] == total
    assert plan(m3, DEP4_256K)["weights_bytes_per_gpu"] == int(total - experts + experts / 4)
    tp4 = plan(m3, dataclasses.replace(DEP4_256K, parallel="tp"))
    assert tp4["weights_bytes_per_gpu"] < total / 4 * 1.001
    # tp splits the 4 KV heads one per GPU; the single index-key head is replicated
    assert tp4["cache_bytes_per_token_per_gpu"] == 61_440 // 4 + 57 * 256
    ep6 = plan(m3, dataclasses.replace(DEP4_256K, parallel="ep", gpus=6))  # 128 experts / 6 -> 22 whole
    assert ep6["weights_bytes_per_gpu"] >= experts * 22 / 128


def test_context_rounds_up_to_whole_kv_blocks_and_oversized_model_fits_nothing():
    tiny = ModelConfig.preset("tiny")  # block 16 tokens
    r = plan(tiny, Deployment(gpus=1, gpu_memory_gb=1, parallel="dep", context_tokens=129))
    assert r["cache_bytes_per_sequence_per_gpu"] == 144 * (
        r["kv_bytes_per_token"] + r["index_cache_bytes_per_token"]
    )
    small_gpu = Deployment(gpus=1, gpu_memory_gb=100, parallel="dep", context_tokens=1024)
    r = plan(ModelConfig.preset("m3"), small_gpu)
    assert r["kv_budget_bytes_per_gpu"] < 0 and r["max_concurrent_sequences"] == 0
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=4096"):
        plan(tiny, Deployment(gpus=1, gpu_memory_gb=1, parallel="dep", context_tokens=8192))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"gpus": 0}, "gpus=0"),
        ({"parallel": "pp"}, "parallel='pp'"),
        ({"gpu_memory_utilization": 1.5}, r"\(0, 1\]"),
    ],
)
def test_deployment_validation(kw, match):
    base = dict(gpus=4, gpu_memory_gb=288, parallel="dep", context_tokens=1024)
    with pytest.raises(ValueError, match=match):
        Deployment(**{**base, **kw})


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "model.capacity", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_json_output_parses_with_required_keys():
    p = run_cli(
        "--preset",
        "m3.1-flash",
        "--gpus",
        "4",
        "--gpu-memory-gb",
        "288",
        "--parallel",
        "dep",
        "--context",
        "256K",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for k in (
        "total_params",
        "active_params",
        "checkpoint_bytes",
        "kv_bytes_per_token",
        "index_cache_bytes_per_token",
        "weights_bytes_per_gpu",
        "kv_budget_bytes_per_gpu",
        "max_concurrent_sequences",
        "gpus",
        "gpu_memory_gb",
        "parallel",
        "context_tokens",
    ):
        assert k in r
    assert r["kv_bytes_per_token"] == 34_560 and r["context_tokens"] == 262_144
    assert (
        r["max_concurrent_sequences"]
        == plan(ModelConfig.preset("m3.1-flash"), DEP4_256K)["max_concurrent_sequences"]
    )


def test_cli_reads_saved_config_and_prints_table(tmp_path):
    ModelConfig.preset("tiny").save_pretrained(tmp_path)
    p = run_cli(
        "--config",
        str(tmp_path),
        "--gpus",
        "1",
        "--gpu-memory-gb",
        "16",
        "--parallel",
        "tp",
        "--context",
        "4096",
        "--kv-dtype",
        "nvfp4",
        "--index-cache-dtype",
        "none",
    )
    assert p.returncode == 0, p.stderr
    assert "max concurrent sequences" in p.stdout and "KV bytes / token (nvfp4)" in p.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (["--preset", "m4"], "valid presets"),
        (["--preset", "m3", "--gpus", "0"], "--gpus: '0' must be > 0"),
        (["--preset", "m3", "--context", "lots"], "give tokens as an int"),
        (["--preset", "m3", "--gpu-memory-utilization", "1.2"], "must be in \\(0, 1\\]"),
        (["--preset", "m3", "--kv-dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_cli_bad_arguments_exit_2_with_fix(args, match):
    base = {"--gpus": "4", "--gpu-memory-gb": "288", "--parallel": "dep", "--context": "4096"}
    for k, v in base.items():
        if k not in args:
            args = [*args, k, v]
    p = run_cli(*args)
    assert p.returncode == 2
    assert pytest.importorskip("re").search(match, p.stderr), p.stderr
