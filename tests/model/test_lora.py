"""LoRA layers on the tiny MiniMax-M3 (NVFP4 routed experts): identity at init, only adapters train,
strict loading, merging, and the rank-32 size budget for the full M3.1-Flash config."""

import dataclasses

import pytest
import torch
from torch import nn

from model.capacity import checkpoint_bytes
from model.checkpoint import base_fingerprint
from model.config import ModelConfig
from model.kernels.moe import moe_experts, moe_experts_ref
from model.layers.lora import (
    DEFAULT_TARGETS,
    TARGET_MODULES,
    ExpertLoRA,
    LoRAConfig,
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_num_bytes,
    lora_num_parameters,
    lora_state_dict,
    merge_lora,
)
from model.layers.moe import ExpertBank, quantize_expert_nvfp4
from model.modeling import MiniMaxM3ForCausalLM

ALL_LINEAR = LoRAConfig(target_modules=list(TARGET_MODULES), routed_experts=True)


def tiny_model(routed: str = "nvfp4", dtype=torch.float32, seed: int = 0) -> MiniMaxM3ForCausalLM:
    cfg = ModelConfig.preset("tiny")
    cfg = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, routed_experts=routed))
    return MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=seed).to(dtype).eval()


def randomize_lora_B_(model: nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Trained-looking adapters: B is zero at init, so outputs would not move otherwise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def ids_BS() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------ config
def test_lora_config_defaults_are_rank32_alpha64_attention_and_mlp():
    cfg = LoRAConfig()
    assert (cfg.r, cfg.alpha, cfg.scaling, cfg.dropout) == (32, 64.0, 2.0, 0.0)
    assert cfg.target_modules == list(DEFAULT_TARGETS) and not cfg.routed_experts
    assert "index_q_proj" not in cfg.target_modules


def test_lora_config_unknown_target_error_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['qkv_proj'\].*'q_proj'.*routed_experts"):
        LoRAConfig(target_modules=["q_proj", "qkv_proj"])


@pytest.mark.parametrize(
    "kwargs, match",
    [({"r": 0}, "r must be a positive int"), ({"alpha": -1}, "alpha"), ({"dropout": 1.0}, "dropout"),
     ({"target_modules": "q_proj"}, "list of names"), ({"target_modules": []}, "no adapter target"),
     ({"dtype": "float16"}, "dtype")],
)  # fmt: skip
def test_lora_config_invalid_field_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


# ------------------------------------------------------------------------------ identity at init
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_adapter_leaves_logits_bit_identical(ids_BS, dtype):
    model = tiny_model(dtype=dtype)
    with torch.no_grad():
        base = model(ids_BS)
        base_h = model.hidden_states(ids_BS)
        apply_lora(model, ALL_LINEAR)
        assert torch.equal(model(ids_BS), base)
        assert torch.equal(model.hidden_states(ids_BS), base_h)


def test_apply_lora_keeps_base_names_fingerprint_and_storage():
    model = tiny_model()
    fp, names = base_fingerprint(model), set(model.state_dict())
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    apply_lora(model, ALL_LINEAR)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.weight is q_weight  # shared, never copied
    assert base_fingerprint(model) == fp
    assert names <= set(model.state_dict())
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert isinstance(model.model.layers[1].block_sparse_moe.experts.lora, ExpertLoRA)
    # The dense MLP, shared expert and indexer got adapters; the router and lm_head did not.
    layer1 = model.model.layers[1]
    assert isinstance(model.model.layers[0].mlp.gate_proj, LoRALinear)
    assert isinstance(layer1.block_sparse_moe.shared_experts.down_proj, LoRALinear)
    assert isinstance(layer1.self_attn.index_k_proj, LoRALinear)
    assert type(layer1.block_sparse_moe.gate) is nn.Linear and type(model.lm_head) is nn.Linear


def test_apply_lora_twice_is_refused():
    model = apply_lora(tiny_model(), LoRAConfig())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoRAConfig())


def test_apply_lora_same_seed_gives_same_adapter():
    a = lora_state_dict(apply_lora(tiny_model(), ALL_LINEAR, seed=3))
    b = lora_state_dict(apply_lora(tiny_model(), ALL_LINEAR, seed=3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.self_attn.q_proj.lora_A.weight"].abs().sum() > 0


# ------------------------------------------------------------------------------ training
def test_adamw_steps_change_only_lora_tensors(ids_BS):
    model = apply_lora(tiny_model(), ALL_LINEAR)
    model.train()
    fp = base_fingerprint(model)
    before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(3):
        logits_BSV = model(ids_BS)
        loss = torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1), ids_BS.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert base_fingerprint(model) == fp
    after = lora_state_dict(model)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    # Every B moves on step 1; A moves from step 2 on (its gradient is B^T(...), zero while B = 0).
    # Indexer projections get no gradient through attention (block selection is discrete).
    assert all(n in changed for n in after if "index_" not in n), sorted(set(after) - changed)[:5]
    assert losses[-1] < losses[0]


def test_expert_lora_grouped_path_matches_reference_loop():
    bank = ExpertBank(4, 32, 16, "nvfp4").init_normal_(0.1, torch.Generator().manual_seed(0))
    bank.lora = ExpertLoRA(bank, r=4, alpha=8, generator=torch.Generator().manual_seed(1))
    randomize_lora_B_(bank, std=0.2)
    g = torch.Generator().manual_seed(2)
    x_TD = torch.randn(10, 32, generator=g)
    ids_TK = torch.randint(0, 4, (10, 2), generator=g)
    w_TK = torch.rand(10, 2, generator=g)
    y = moe_experts(x_TD, ids_TK, w_TK, bank)
    torch.testing.assert_close(y, moe_experts_ref(x_TD, ids_TK, w_TK, bank), rtol=1e-5, atol=1e-6)
    bank.lora = None
    assert (y - moe_experts(x_TD, ids_TK, w_TK, bank)).abs().max() > 1e-3  # the adapter did something


@torch.no_grad()
def test_cached_decode_with_adapter_reproduces_training_forward():
    """The engine step (paged cache) and the learner's forward see the same adapted model."""
    model = apply_lora(tiny_model(), ALL_LINEAR)
    randomize_lora_B_(model)
    ids_S = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(4))
    full_SV = model(ids_S.unsqueeze(0))[0]
    n_pages = -(-37 // model.config.index_block_size)
    cache = model.new_kv_cache(n_pages, dtype="fp32")
    table_1P = torch.arange(n_pages).unsqueeze(0)
    rows = [
        model.forward_cached(ids_S[t : t + 1], torch.tensor([t]), torch.tensor([0]), cache, table_1P,
                             torch.tensor([t + 1]))
        for t in range(37)
    ]  # fmt: skip
    torch.testing.assert_close(torch.cat(rows), full_SV, atol=1e-5, rtol=0)
    assert (full_SV - tiny_model()(ids_S.unsqueeze(0))[0]).abs().max() > 1e-3  # the adapter is live


# ------------------------------------------------------------------------------ state dict
def test_lora_state_dict_round_trip_reproduces_logits(ids_BS):
    trained = apply_lora(tiny_model(), ALL_LINEAR, seed=0)
    randomize_lora_B_(trained)
    fresh = apply_lora(tiny_model(), ALL_LINEAR, seed=5)
    load_lora_state_dict(fresh, lora_state_dict(trained))
    with torch.no_grad():
        assert torch.equal(fresh(ids_BS), trained(ids_BS))


def test_lora_state_dict_names_look_like_peft():
    sd = lora_state_dict(apply_lora(tiny_model(), ALL_LINEAR))
    assert sd["model.layers.2.self_attn.q_proj.lora_A.weight"].shape == (32, 128)
    assert sd["model.layers.2.self_attn.q_proj.lora_B.weight"].shape == (128, 32)
    assert sd["model.layers.1.block_sparse_moe.experts.lora.w2.lora_B"].shape == (8, 128, 32)
    assert all("lora_" in n for n in sd)


def test_load_lora_state_dict_strict_errors_name_the_problem():
    model = apply_lora(tiny_model(), LoRAConfig(r=8))
    good = lora_state_dict(model)
    key = "model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(ValueError, match=r"missing 1 tensors.*q_proj\.lora_A"):
        load_lora_state_dict(model, {k: v for k, v in good.items() if k != key})
    with pytest.raises(ValueError, match=r"unexpected 1 tensors.*index_q_proj"):
        load_lora_state_dict(
            model, {**good, "model.layers.1.self_attn.index_q_proj.lora_A.weight": good[key]}
        )
    with pytest.raises(ValueError, match=r"shape mismatches.*got \(16, 128\), model has \(8, 128\)"):
        load_lora_state_dict(model, {**good, key: torch.zeros(16, 128)})
    with pytest.raises(ValueError, match="no LoRA adapters"):
        load_lora_state_dict(tiny_model(), good)


# ------------------------------------------------------------------------------ merge
def test_merge_lora_float_model_matches_adapter_output(ids_BS):
    model = apply_lora(tiny_model(routed="bf16"), ALL_LINEAR)
    randomize_lora_B_(model)
    with torch.no_grad():
        want = model(ids_BS)
        exact = merge_lora(model)
        got = model(ids_BS)
    assert all(st.error_sq == 0 for st in exact.values())  # a float bank: nothing re-quantized
    assert not any("lora_" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_merge_lora_nvfp4_experts_requantizes_with_bank_function():
    model = apply_lora(tiny_model(), LoRAConfig(target_modules=["q_proj"], routed_experts=True))
    randomize_lora_B_(model)
    bank = model.model.layers[1].block_sparse_moe.experts
    w1_exact = bank.dequantized(0)[0] + bank.lora.delta_weight(0, "w1")
    w3_exact = bank.dequantized(0)[1] + bank.lora.delta_weight(0, "w3")
    stats = merge_lora(model)
    assert bank.w1_weight.dtype == torch.uint8 and bank.lora is None
    # Exactly the bits the converter's function gives for the merged float weights.
    want = quantize_expert_nvfp4(w1_exact, w3_exact, bank.dequantized(0)[2])["w1"]
    assert torch.equal(bank.w1_weight[0], want.packed) and torch.equal(
        bank.w1_weight_scale_2[0], want.scale_2
    )
    st = stats["model.layers.1.block_sparse_moe.experts.w1"]
    assert 0.01 < st.rel_error < 0.15  # NVFP4 rounding of the merged weight, reported
    assert st.delta_sq > 0 and st.error_over_delta > 0


# ------------------------------------------------------------------------------ size budget
def test_rank32_adapter_on_m31_flash_is_under_one_percent_of_nvfp4_checkpoint():
    cfg = ModelConfig.preset("m3.1-flash")
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg)
    apply_lora(model, LoRAConfig())  # r=32 on q/k/v/o + dense MLP + shared experts, fp32
    n, nbytes, ckpt = lora_num_parameters(model), lora_num_bytes(model), checkpoint_bytes(cfg)
    L, D, C = cfg.num_hidden_layers, cfg.hidden_size, cfg.q_size
    attn = L * 32 * ((D + C) * 2 + 2 * (D + cfg.kv_size))
    mlp = 3 * 32 * (3 * (D + cfg.dense_intermediate_size) + 57 * (D + cfg.shared_intermediate_size))
    assert n == attn + mlp
    print(f"\nm3.1-flash rank-32 LoRA: {n / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB fp32 = "
          f"{100 * nbytes / ckpt:.3f}% of the {ckpt / 1e9:.1f} GB NVFP4 checkpoint")  # fmt: skip
    assert nbytes / ckpt < 0.01
