"""`python -m rl.export`: a servable PEFT adapter with a card, and a merged checkpoint that loads and
matches base + adapter within the quantization error it reports."""

import dataclasses
import json

import pytest
import torch

from model.adapter import AdapterMetadata, read_adapter, save_adapter
from model.checkpoint import base_fingerprint, load_model, save_model
from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora
from model.modeling import MiniMaxM3ForCausalLM
from rl.export import REPORT_FILE, main

ATTN_MLP_EXPERTS = LoRAConfig(
    r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    routed_experts=True,
)  # fmt: skip


def tiny_config(**quant) -> ModelConfig:
    cfg = ModelConfig.preset("tiny")
    return dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, **quant))


def make_base(path, cfg: ModelConfig, seed: int = 0):
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=seed).to(torch.bfloat16)
    save_model(model, path)
    return path


def make_adapter(path, base_dir, lcfg: LoRAConfig, step: int = 5, metrics=None):
    """Train-like adapter on the base as a learner loads it (bf16), fingerprint recorded."""
    model = apply_lora(load_model(base_dir), lcfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    meta = AdapterMetadata(base_fingerprint=base_fingerprint(model), step=step, metrics=metrics or {})
    save_adapter(model, path, lcfg, base_model_name_or_path=str(base_dir), metadata=meta)
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("base"), tiny_config())


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, base_dir):
    return make_adapter(
        tmp_path_factory.mktemp("adapter"), base_dir, ATTN_MLP_EXPERTS, metrics={"reward": 0.67}
    )


# ------------------------------------------------------------------------------ peft
def test_export_peft_copies_adapter_and_writes_card(tmp_path, adapter_dir, base_dir, capsys):
    out = tmp_path / "out"
    assert main([str(adapter_dir), "--out", str(out), "--base", str(base_dir)]) == 0
    for f in ("adapter_config.json", "adapter_model.safetensors", "adapter_metadata.json"):
        assert (out / f).read_bytes() == (adapter_dir / f).read_bytes()
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and f"base_model: {base_dir}" in card
    assert "| rank r / alpha (scaling) | 8 / 16 (2) |" in card and "| training step | 5 |" in card
    assert "| reward | 0.67 |" in card and "routed experts" in card
    assert "r=8" in capsys.readouterr().out


def test_export_peft_from_run_dir_takes_highest_step(tmp_path, base_dir):
    run = tmp_path / "run"
    for step in (10, 30, 20):
        make_adapter(run / "checkpoints" / f"step_{step}" / "adapter", base_dir, LoRAConfig(r=4), step=step)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert read_adapter(tmp_path / "out")[2].step == 30


def test_export_refuses_adapter_for_another_base_shape(tmp_path, adapter_dir, capsys):
    other = make_base(tmp_path / "other", dataclasses.replace(tiny_config(), dense_intermediate_size=128))
    assert main([str(adapter_dir), "--out", str(tmp_path / "out"), "--base", str(other)]) == 1
    err = capsys.readouterr().err
    assert "does not fit base" in err and "shape mismatches" in err and "mlp.gate_proj" in err


def test_export_missing_adapter_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "no adapter_config.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------ merged
def test_export_merged_loads_and_matches_base_plus_adapter(tmp_path, adapter_dir, base_dir, capsys):
    out = tmp_path / "merged"
    assert main([str(adapter_dir), "--out", str(out), "--format", "merged"]) == 0  # base from adapter config
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["verified"] and report["untouched_changed"] == []
    bf16, experts = report["groups"]["bf16"], report["groups"]["routed_experts:nvfp4"]
    assert bf16["modules"] == 4 * 4 + 2 + 3 * 2  # q/k/v/o x 4 layers, dense gate/down, shared gate/down
    assert bf16["rel_error"] < 5e-3  # one bf16 rounding of the fp32 merge
    assert experts["modules"] == 3 * 3 and 0.01 < experts["rel_error"] < 0.2  # NVFP4 re-quantization
    lg = report["logits"]
    assert lg["adapter_effect_rms"] > 0.05 and lg["export_error_rms"] < 0.25 * lg["adapter_effect_rms"]
    merged = load_model(out)  # a plain checkpoint: no adapter tensors, same config
    assert not any("lora" in n for n in merged.state_dict())
    assert merged.config == ModelConfig.from_pretrained(base_dir)
    assert "added error" in capsys.readouterr().out


def test_export_merged_requantizes_nvfp4_attention_and_reports_error(tmp_path):
    base = make_base(tmp_path / "base", tiny_config(attention="nvfp4"))
    adapter = make_adapter(
        tmp_path / "adapter", base, LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "o_proj"])
    )
    out = tmp_path / "merged"
    assert main([str(adapter), "--out", str(out), "--format", "merged", "--base", str(base)]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    nv = report["groups"]["nvfp4"]
    assert nv["modules"] == 2 * 4 and 0.01 < nv["rel_error"] < 0.2
    # Untouched NVFP4 k/v/indexer weights are re-quantized by save_model: their global scale may move
    # by an ulp (amax recomputed from dequantized values), nothing more.
    assert report["untouched_max_rel_change"] < 1e-6
    lg = report["logits"]
    assert lg["export_error_rms"] < lg["adapter_effect_rms"]


def test_export_merged_refuses_adapter_trained_on_another_base(tmp_path, adapter_dir, capsys):
    other = make_base(tmp_path / "other", tiny_config(), seed=1)  # same shapes, other weights
    assert (
        main([str(adapter_dir), "--out", str(tmp_path / "m"), "--format", "merged", "--base", str(other)])
        == 1
    )
    assert "load the base it was trained on" in capsys.readouterr().err
