"""The layouts the project writes load in transformers and in vLLM, and files written earlier still load.

A float tiny M3 (sparse attention, MoE, bf16 experts) exported merged (`rl.export --format merged`)
is a `minimax_m3_vl_text` directory in the port's tensor names: transformers' AutoModelForCausalLM
loads it with no missing or unexpected tensor and gives the project model's logits (fp32, 1e-5), and
vLLM's config loader (with the project's plugin, as the rollout backend runs it) parses it with the
same layer pattern. A quantized (NVFP4) conversion is the released `minimax_m3_vl` wrapper, which
vLLM parses without the plugin. A checkpoint in the old `minimax_m3_text` layout still loads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from model.adapter import AdapterMetadata, save_adapter
from model.checkpoint import base_fingerprint, load_model, save_model, state_for_save
from model.config import ModelConfig, QuantConfig
from model.convert import convert
from model.hf_layout import from_port_names, to_port_names
from model.layers.lora import LoRAConfig, apply_lora
from model.modeling import MiniMaxM3ForCausalLM
from rl.export import export_merged

FLOAT_TINY = dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig())
IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))  # 3 index blocks of 16


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(merged export directory, base + adapter model in fp32)."""
    root = tmp_path_factory.mktemp("layout")
    base = MiniMaxM3ForCausalLM(FLOAT_TINY).init_weights(std=0.05, seed=0)
    save_model(base, root / "base")
    lcfg = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    model = apply_lora(load_model(root / "base", dtype=torch.float32), lcfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    meta = AdapterMetadata(base_fingerprint=base_fingerprint(model), base_dtype="float32")
    save_adapter(model, root / "adapter", lcfg, base_model_name_or_path=str(root / "base"), metadata=meta)
    export_merged(root / "adapter", root / "merged", dtype="float32")
    return root / "merged", model.eval()


def test_merged_float_export_is_a_transformers_text_model_with_the_project_logits(merged):
    from transformers import AutoModelForCausalLM

    out, model = merged
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "minimax_m3_vl_text" and cfg["architectures"] == [
        "MiniMaxM3SparseForCausalLM"
    ]
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(hf).__name__ == "MiniMaxM3VLForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        want, got = model(IDS), hf.eval()(IDS).logits
    assert (want - got).abs().max().item() < 1e-5


def test_vllm_config_loader_parses_the_merged_export(merged):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config

    from rollout.vllm_m3 import register

    register()
    out, model = merged
    c = get_config(str(out), trust_remote_code=False)
    cfg = model.config
    assert type(c).__name__ == "MiniMaxM3TextConfigForVLLM" and c.architectures == [
        "MiniMaxM3SparseForCausalLM"
    ]
    assert c.sparse_attention_config["sparse_attention_freq"] == [
        int(cfg.is_sparse_layer(i)) for i in range(4)
    ]
    assert c.moe_layer_freq == [int(cfg.is_moe_layer(i)) for i in range(4)]
    assert c.hidden_act == "swigluoai" and c.intermediate_size == cfg.moe_intermediate_size
    assert c.partial_rotary_factor == cfg.rotary_dim / cfg.head_dim and c.rope_theta == cfg.rope_theta


def test_quantized_conversion_is_the_released_wrapper_vllm_parses(tmp_path, merged):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config

    out, _ = merged
    cfg = convert(out, tmp_path / "nvfp4")
    d = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    assert d["model_type"] == "minimax_m3_vl" and d["architectures"] == ["MiniMaxM3SparseForCausalLM"]
    assert (
        d["quantization_config"]["quant_method"] == "modelopt"
        and "quantization_config" not in d["text_config"]
    )
    c = get_config(str(tmp_path / "nvfp4"), trust_remote_code=False)
    assert type(c).__name__ == "MiniMaxM3Config"
    assert c.text_config.moe_layer_freq == [int(cfg.is_moe_layer(i)) for i in range(4)]
    assert c.quantization_config["quant_algo"] == "W4A16_NVFP4"  # weight-only: the H200 default
    index = json.loads((tmp_path / "nvfp4" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale" in index  # checkpoint names
    assert ModelConfig.from_pretrained(tmp_path / "nvfp4") == cfg
    assert load_model(tmp_path / "nvfp4").config.quantization.routed_experts == "nvfp4"


def test_checkpoint_in_the_old_minimax_m3_text_layout_still_loads(tmp_path):
    model = MiniMaxM3ForCausalLM(FLOAT_TINY).init_weights(std=0.05, seed=3).float()
    old = {**FLOAT_TINY.to_hf_dict(), "model_type": "minimax_m3_text"}
    for key in ("layer_types", "mlp_layer_types", "rope_parameters"):  # legacy keys only
        old.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(old))
    from safetensors.torch import save_file

    save_file(dict(state_for_save(model)), str(tmp_path / "model.safetensors"))  # checkpoint names
    back = load_model(tmp_path, dtype=torch.float32)
    assert back.config == FLOAT_TINY
    with torch.no_grad():
        assert torch.equal(back(IDS), model(IDS))


def test_port_names_round_trip_and_saved_float_checkpoint_uses_them(tmp_path):
    model = MiniMaxM3ForCausalLM(FLOAT_TINY).init_weights(std=0.05, seed=4)
    state = dict(state_for_save(model))
    port = dict(to_port_names(state.items(), FLOAT_TINY.num_local_experts))
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" in port and "model.layers.0.mlp.gate_up_proj.weight" in port
    )
    assert "model.layers.1.self_attn.indexer.q_proj.weight" in port
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in port
    back = dict(from_port_names(port.items()))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    save_model(model, tmp_path)
    assert load_file(tmp_path / "model-00001.safetensors").keys() == port.keys()
