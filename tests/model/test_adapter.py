"""The PEFT adapter format: round trip, key naming, refusal of adapters that do not fit, and the
cross-check against the transformers port with `peft.PeftModel.from_pretrained` (and vLLM's
PEFTHelper when vllm is importable)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from model.adapter import (
    CONFIG_FILE,
    METADATA_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterMetadata,
    load_adapter,
    read_adapter,
    save_adapter,
    to_hf_twin,
)
from model.checkpoint import base_fingerprint
from model.config import ModelConfig
from model.layers.lora import TARGET_MODULES, LoRAConfig, apply_lora, lora_state_dict
from model.modeling import MiniMaxM3ForCausalLM

ATTN = LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
ALL = LoRAConfig(r=8, alpha=16, target_modules=list(TARGET_MODULES), routed_experts=True)


def tiny_model(seed: int = 0) -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=seed).float().eval()


def trained(cfg: LoRAConfig, seed: int = 0) -> MiniMaxM3ForCausalLM:
    model = apply_lora(tiny_model(seed), cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def ids_BS() -> torch.Tensor:
    # 24 tokens: the tiny config's top-2 blocks of 16 cover every block, so MSA = dense attention in
    # both implementations and the comparison tests only the weights, not two indexers' tie-breaking.
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------ round trip
def test_save_read_round_trip_is_bit_identical_with_expert_adapters(tmp_path):
    model = trained(ALL)
    meta = AdapterMetadata(base_fingerprint=base_fingerprint(model), step=7, metrics={"reward": 0.5})
    save_adapter(model, tmp_path, ALL, base_model_name_or_path="tiny", metadata=meta)
    cfg, tensors, meta2 = read_adapter(tmp_path)
    want = lora_state_dict(model)
    assert cfg == ALL and meta2 == meta
    assert tensors.keys() == want.keys()
    assert all(torch.equal(tensors[k], want[k]) for k in want)


def test_saved_file_uses_peft_key_names_and_config_fields(tmp_path):
    save_adapter(trained(ALL), tmp_path, ALL, base_model_name_or_path="MiniMaxAI/tiny")
    keys = set(load_file(str(tmp_path / WEIGHTS_FILE)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight" in keys
    assert "base_model.model.model.layers.3.block_sparse_moe.experts.7.w2.lora_A.weight" in keys
    assert not any(".default." in k for k in keys)
    raw = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert raw["peft_type"] == "LORA" and raw["task_type"] == "CAUSAL_LM" and raw["bias"] == "none"
    assert (raw["r"], raw["lora_alpha"], raw["base_model_name_or_path"]) == (8, 16, "MiniMaxAI/tiny")
    assert "self_attn.q_proj" in raw["target_modules"] and "shared_experts.up_proj" in raw["target_modules"]
    assert json.loads((tmp_path / METADATA_FILE).read_text())["routed_experts"] is True


def test_load_adapter_into_fresh_model_reproduces_logits(tmp_path, ids_BS):
    model = trained(ALL)
    save_adapter(model, tmp_path, ALL, metadata=AdapterMetadata(base_fingerprint=base_fingerprint(model)))
    fresh = tiny_model()
    load_adapter(fresh, tmp_path, expected=ALL, base_fingerprint=base_fingerprint(fresh))
    with torch.no_grad():
        assert torch.equal(fresh(ids_BS), model(ids_BS))


# ------------------------------------------------------------------------------ refusals
def test_adapter_with_other_rank_targets_or_base_is_refused(tmp_path):
    model = trained(ATTN)
    save_adapter(model, tmp_path, ATTN, metadata=AdapterMetadata(base_fingerprint=base_fingerprint(model)))
    with pytest.raises(AdapterError, match="r=8 but 32 expected"):
        load_adapter(tiny_model(), tmp_path, expected=dataclasses.replace(ATTN, r=32, alpha=64))
    with pytest.raises(AdapterError, match="target_modules="):
        load_adapter(tiny_model(), tmp_path, expected=dataclasses.replace(ATTN, target_modules=["q_proj"]))
    other = tiny_model(seed=1)
    with pytest.raises(AdapterError, match=r"trained on base .* load the base it was trained on"):
        load_adapter(other, tmp_path, base_fingerprint=base_fingerprint(other))
    # A model that already carries adapters of another rank: shape mismatch, named.
    with pytest.raises(AdapterError, match=r"shape mismatches.*\(8, 128\)"):
        load_adapter(apply_lora(tiny_model(), dataclasses.replace(ATTN, r=4)), tmp_path)


def test_adapter_config_inconsistent_with_tensors_is_refused(tmp_path):
    save_adapter(trained(ATTN), tmp_path, ATTN)
    raw = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**raw, "r": 16}))
    with pytest.raises(AdapterError, match=r"has rank 8 but adapter_config\.json says r=16"):
        read_adapter(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**raw, "target_modules": ["self_attn.qkv_proj"]}))
    with pytest.raises(AdapterError, match=r"unknown module\(s\) \[.qkv_proj.\]"):
        read_adapter(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(tmp_path)


def test_missing_or_truncated_adapter_files_are_refused(tmp_path):
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        read_adapter(tmp_path)
    save_adapter(trained(ATTN), tmp_path, ATTN)
    data = (tmp_path / WEIGHTS_FILE).read_bytes()
    (tmp_path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        read_adapter(tmp_path)


# ------------------------------------------------------------------------------ HF / PEFT / vLLM
def test_hf_twin_base_logits_match_ours(ids_BS):
    model = tiny_model()  # NVFP4 routed experts, dequantized into the twin
    with torch.no_grad():
        torch.testing.assert_close(to_hf_twin(model)(ids_BS).logits, model(ids_BS), rtol=0, atol=1e-5)


def test_peft_from_pretrained_on_hf_twin_gives_our_logits(tmp_path, ids_BS):
    peft = pytest.importorskip("peft")
    model = trained(ATTN)
    save_adapter(model, tmp_path, ATTN, base_model_name_or_path="tiny")
    twin = peft.PeftModel.from_pretrained(to_hf_twin(model), str(tmp_path)).eval()
    assert len([n for n, _ in twin.named_parameters() if "lora_A" in n]) == 4 * 4  # q/k/v/o, not indexer
    with torch.no_grad():
        ours, theirs = model(ids_BS), twin(ids_BS).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - tiny_model()(ids_BS)).abs().max() > 1e-3  # the adapter changes the logits


def test_vllm_peft_helper_accepts_adapter_config(tmp_path):
    peft_helper = pytest.importorskip("vllm.lora.peft_helper")
    save_adapter(trained(ALL), tmp_path, ALL, base_model_name_or_path="tiny")
    helper = peft_helper.PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=4096)
    assert (helper.r, helper.lora_alpha, helper.vllm_lora_scaling_factor) == (8, 16, 2.0)
    assert helper._validate_features() == []


def test_vllm_lora_model_loads_every_adapter_tensor_with_checkpoint_names(tmp_path):
    pytest.importorskip("vllm")
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    model = trained(ALL)
    save_adapter(model, tmp_path, ALL, base_model_name_or_path="tiny")
    # What vLLM's worker expects for a 2D MoE model whose expert mapping uses the checkpoint names
    # (`experts.{e}.w1/w2/w3`, as for MiniMax): the linear suffixes plus one entry per expert weight.
    expected = set(TARGET_MODULES) | {"experts"}
    expected |= {f"experts.{e}.{w}" for e in range(8) for w in ("w1", "w2", "w3")}
    helper = PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=4096)
    loaded = LoRAModel.from_local_checkpoint(
        str(tmp_path), expected, helper, device="cpu", dtype=torch.float32
    )
    ours = lora_state_dict(model)
    n_linear = sum(n.endswith("lora_A.weight") for n in ours)
    assert len(loaded.loras) == n_linear + 3 * 3 * 8  # + 3 MoE layers x 3 projections x 8 experts
    q = loaded.loras["model.layers.0.self_attn.q_proj"]
    assert torch.equal(q.lora_a, ours["model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.lora_b, ours["model.layers.0.self_attn.q_proj.lora_B.weight"]) and q.scaling == 2.0
    w2 = loaded.loras["model.layers.1.block_sparse_moe.experts.3.w2"]
    assert torch.equal(w2.lora_b, ours["model.layers.1.block_sparse_moe.experts.lora.w2.lora_B"][3])
