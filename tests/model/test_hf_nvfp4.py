"""NVFP4 frozen base + PEFT LoRA on Hugging Face causal LMs (tiny random Qwen3 / Llama, no hub):
exact quantized forward, PEFT wrapping, LoRA-only training, the dequantized twin for serving and
vLLM's PEFTHelper accepting the adapter."""

import copy
import json

import pytest
import torch
import transformers
from peft import PeftModel

from model.checkpoint import base_fingerprint
from model.hf_nvfp4 import (
    SOURCE_FILE,
    NVFP4Linear,
    NVFP4LoraLinear,
    apply_peft_lora,
    export_dequantized_base,
    hf_base_fingerprint,
    load_peft_lora,
    quantize_hf_model,
)
from model.nvfp4 import dequantize, quantize, to_modelopt

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256,
)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen3(**kw):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, **kw)).float().eval()


def llama(**kw):
    # Tied embeddings and attention biases: the two HF features the quantizer must handle specially.
    cfg = transformers.LlamaConfig(**TINY, attention_bias=True, tie_word_embeddings=True, **kw)
    return transformers.LlamaForCausalLM(cfg).float().eval()


ARCHS = {"qwen3": qwen3, "llama": llama}


def ids(b=2, s=9, seed=1):
    return torch.randint(0, TINY["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def nvfp4_buffers(model):
    return {
        n: b for n, b in model.named_buffers() if n.endswith(("weight", "weight_scale", "weight_scale_2"))
    }


def trained(model, steps=3, lr=1e-2):
    """PEFT-wrapped quantized model after a few AdamW steps on next-token CE over random ids."""
    peft_model = apply_peft_lora(model, r=8, alpha=16, target_modules=TARGETS)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    x = ids(seed=2)
    for _ in range(steps):
        loss = peft_model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return peft_model.eval()


# ------------------------------------------------------------------------------ quantization
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_forward_equals_linears_holding_dequantized_weights(arch):
    model = ARCHS[arch]()
    reference = copy.deepcopy(model)
    stats = quantize_hf_model(model)
    with torch.no_grad():
        for name in stats["quantized"]:
            lin = reference.get_submodule(name)
            lin.weight.copy_(dequantize(quantize(lin.weight)))
    assert stats["num_quantized"] == 2 * 7 and "lm_head" not in stats["quantized"]
    torch.testing.assert_close(logits(model, ids()), logits(reference, ids()), rtol=0, atol=1e-6)


def test_state_dict_is_the_modelopt_layout_of_the_project_quantizer():
    model = qwen3()
    w = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    quantize_hf_model(model)
    sd = model.state_dict()
    want = to_modelopt("model.layers.1.mlp.down_proj.", quantize(w))
    for key, t in want.items():
        assert sd[key].dtype == t.dtype and torch.equal(bits(sd[key]), bits(t)), key
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 64)  # [N, K/2] of a 64x128 weight
    assert base_fingerprint(model) == hf_base_fingerprint(model)  # plain model: same names


def test_quantize_reports_bytes_and_skips_with_reasons():
    model = llama()
    model.model.extra = torch.nn.Linear(24, 32)  # K = 24: not a multiple of the 16-value block
    model.model.tiny = torch.nn.Linear(64, 8)  # below min_features
    stats = quantize_hf_model(model, exclude=())
    assert "tied" in stats["skipped"]["lm_head"]  # exclude=() but lm_head shares embed_tokens.weight
    assert "multiple of 16" in stats["skipped"]["model.extra"]
    assert "min_features" in stats["skipped"]["model.tiny"]
    shapes = [model.get_submodule(n).weight.shape for n in stats["quantized"]]
    assert stats["bytes_before"] == sum(n * 2 * k * 4 for n, k in shapes)  # fp32 weights
    assert stats["bytes_after"] == sum(n * k + n * (2 * k) // 16 + 4 for n, k in shapes)
    assert not any(p.requires_grad for p in model.parameters())  # the whole base is frozen


def test_include_patterns_select_modules():
    model = qwen3()
    stats = quantize_hf_model(model, include=["mlp.*"])
    assert sorted(stats["quantized"]) == sorted(
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert stats["skipped"]["model.layers.0.self_attn.q_proj"] == "not in include"
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_to_bf16_casts_bias_but_never_the_nvfp4_buffers():
    model = llama()
    quantize_hf_model(model)
    before = {n: b.clone() for n, b in nvfp4_buffers(model).items()}
    model.to(torch.bfloat16)
    after = nvfp4_buffers(model)
    for n, b in before.items():
        assert after[n].dtype == b.dtype and torch.equal(bits(after[n]), bits(b)), n
    q = model.model.layers[0].self_attn.q_proj
    assert q.bias.dtype == torch.bfloat16 and logits(model, ids()).dtype == torch.bfloat16


def test_quantizing_a_peft_model_is_refused():
    model = qwen3()
    quantize_hf_model(model, include=["q_proj"])
    peft_model = apply_peft_lora(model, r=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="quantize first"):
        quantize_hf_model(peft_model)


# ------------------------------------------------------------------------------ PEFT LoRA
def test_peft_wraps_nvfp4_modules_and_fresh_adapter_is_bit_identical():
    model = qwen3()
    quantize_hf_model(model)
    base_logits, fp = logits(model, ids()), hf_base_fingerprint(model)
    peft_model = apply_peft_lora(model, r=8, alpha=16, target_modules=TARGETS)
    wrapped = [m for m in peft_model.modules() if isinstance(m, NVFP4LoraLinear)]
    assert len(wrapped) == 2 * 7 and all(isinstance(m.base_layer, NVFP4Linear) for m in wrapped)
    assert torch.equal(logits(peft_model, ids()), base_logits)
    assert hf_base_fingerprint(peft_model) == fp
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with peft_model.disable_adapter():
        assert torch.equal(logits(peft_model, ids()), base_logits)


def test_training_changes_only_lora_tensors_and_no_grad_reaches_the_base():
    model = llama()
    quantize_hf_model(model)
    base_logits, fp = logits(model, ids()), hf_base_fingerprint(model)
    peft_model = apply_peft_lora(model, r=8, alpha=16, target_modules=TARGETS)
    lora_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    x = ids(seed=2)
    for _ in range(3):
        loss = peft_model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        for n, b in peft_model.named_buffers():
            assert b.grad is None and not b.requires_grad, n
        assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)
        opt.step()
    assert hf_base_fingerprint(peft_model) == fp
    changed = [n for n, p in peft_model.named_parameters() if not torch.equal(p, lora_before.get(n, p))]
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    assert (logits(peft_model, ids()) - base_logits).abs().max() > 1e-3


def test_merge_is_refused_with_a_pointer_to_the_twin():
    model = qwen3()
    quantize_hf_model(model)
    peft_model = apply_peft_lora(model, r=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(NotImplementedError, match="dequantized twin"):
        peft_model.merge_and_unload()


def test_saved_adapter_reloads_on_a_fresh_quantized_base_bit_identically(tmp_path):
    torch.manual_seed(3)
    model = qwen3()
    fresh = copy.deepcopy(model)
    quantize_hf_model(model)
    peft_model = trained(model)
    peft_model.save_pretrained(tmp_path / "adapter")
    quantize_hf_model(fresh)
    reloaded = load_peft_lora(fresh, tmp_path / "adapter")
    assert torch.equal(logits(reloaded, ids()), logits(peft_model, ids()))


# ------------------------------------------------------------------------------ twin + serving
@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_on_reloaded_dequantized_twin_gives_the_same_logits(arch, tmp_path):
    model = ARCHS[arch]()
    quantize_hf_model(model)
    peft_model = trained(model)
    peft_model.save_pretrained(tmp_path / "adapter")
    export_dequantized_base(peft_model, tmp_path / "twin", dtype=torch.float32)
    twin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    served = PeftModel.from_pretrained(twin, tmp_path / "adapter").eval()
    assert sum("lora_A" in n for n, _ in served.named_parameters()) == 2 * 7
    torch.testing.assert_close(logits(served, ids()), logits(peft_model, ids()), rtol=0, atol=1e-5)
    with served.disable_adapter():
        assert (logits(served, ids()) - logits(peft_model, ids())).abs().max() > 1e-3  # adapter matters


def test_bf16_twin_holds_exactly_the_weights_nvfp4_linear_multiplies_by(tmp_path):
    model = llama()
    quantize_hf_model(model)
    export_dequantized_base(model, tmp_path)
    twin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert twin.dtype == torch.bfloat16
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            w = twin.get_submodule(name).weight
            assert torch.equal(w, dequantize(m.nvfp4, torch.bfloat16)), name
    # The tied lm_head stays tied to the (unquantized) embeddings.
    assert twin.lm_head.weight.data_ptr() == twin.model.embed_tokens.weight.data_ptr()
    source = json.loads((tmp_path / SOURCE_FILE).read_text())
    assert source["nvfp4_base_fingerprint"] == hf_base_fingerprint(model)
    assert len(source["quantized_modules"]) == 2 * 7


def test_vllm_peft_helper_and_lora_model_accept_the_adapter(tmp_path):
    peft_helper = pytest.importorskip("vllm.lora.peft_helper")
    from vllm.config.lora import LoRAConfig as VllmLoRAConfig
    from vllm.lora.lora_model import LoRAModel

    model = qwen3()
    quantize_hf_model(model)
    peft_model = trained(model, steps=1)
    peft_model.save_pretrained(tmp_path)
    helper = peft_helper.PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=4096)
    assert (helper.r, helper.lora_alpha, helper.vllm_lora_scaling_factor) == (8, 16, 2.0)
    assert sorted(helper.target_modules) == sorted(TARGETS)
    helper.validate_legal(VllmLoRAConfig(max_lora_rank=8))
    with pytest.raises(ValueError, match="max_lora_rank"):
        helper.validate_legal(VllmLoRAConfig(max_lora_rank=4))
    # The tensors under the names vLLM's Qwen3 looks up (it packs q/k/v and gate/up itself).
    loaded = LoRAModel.from_local_checkpoint(
        str(tmp_path), set(TARGETS), helper, device="cpu", dtype=torch.float32
    )
    assert len(loaded.loras) == 2 * 7
    q = loaded.loras["model.layers.1.self_attn.q_proj"]
    wrapped = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(q.lora_a, wrapped.lora_A["default"].weight)
    assert torch.equal(q.lora_b, wrapped.lora_B["default"].weight)
