"""MoE block: swigluoai, router, grouped experts (float / NVFP4 / MXFP8), nvfp4_linear, gradients,
checkpoint-name round trips, and agreement with the transformers MiniMax-M3 port."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from model.config import ModelConfig
from model.kernels.moe import moe_experts, moe_experts_ref, swigluoai
from model.kernels.nvfp4_linear import TILE_N, nvfp4_linear, nvfp4_linear_ref
from model.layers.moe import DenseMLP, ExpertBank, MoE, expert_format
from model.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from model.nvfp4 import E2M1_VALUES, quantize

E, D, F, K = 8, 128, 64, 2  # the tiny preset's MoE sizes


def _cfg(**kw) -> ModelConfig:
    cfg = ModelConfig.preset("tiny")
    assert (cfg.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size) == (E, D, F)
    return dataclasses.replace(cfg, **kw) if kw else cfg


def _weights(seed: int = 0, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, F, D, generator=g) * scale
    w3 = torch.randn(E, F, D, generator=g) * scale
    w2 = torch.randn(E, D, F, generator=g) * scale
    return w1, w3, w2


def _moe(fmt: str, seed: int = 0) -> MoE:
    """A tiny MoE with random router, bias, shared expert, and experts stored in `fmt`."""
    torch.manual_seed(seed)
    m = MoE(_cfg(), fmt=fmt)
    with torch.no_grad():
        m.gate.weight.normal_(0, 0.1)
        m.e_score_correction_bias.normal_(0, 0.05)
        for lin in (m.shared_experts.gate_proj, m.shared_experts.up_proj, m.shared_experts.down_proj):
            lin.weight.normal_(0, 0.05)
    m.experts = ExpertBank.from_float(*_weights(seed), fmt)
    return m


def _routing(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    # Ragged loads: expert 5 is never chosen, expert 0 gets its slots.
    ids[:, 0] = torch.where(ids[:, 0] == 5, 0, ids[:, 0])
    ids[:, 1] = torch.where(ids[:, 1] == 5, 0, ids[:, 1])
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    weights = torch.rand(t, K, generator=g)
    return x, ids, weights


# ------------------------------------------------------------------------------- swigluoai
def test_swigluoai_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([10.0, 7.0, -3.0, 2.0], dtype=torch.float64)
    up = torch.tensor([-10.0, 9.0, 0.5, -7.5], dtype=torch.float64)
    out = swigluoai(gate, up, 1.702, 7.0)
    g = torch.tensor([7.0, 7.0, -3.0, 2.0], dtype=torch.float64)  # gate: max 7, no lower clamp
    u = torch.tensor([-7.0, 7.0, 0.5, -7.0], dtype=torch.float64)  # up: clamped to [-7, 7]
    expected = g * torch.sigmoid(1.702 * g) * (u + 1)
    assert torch.equal(out, expected)
    # Saturation: anything above the limit gives the same output as the limit itself.
    assert torch.equal(swigluoai(torch.tensor([100.0]), torch.tensor([100.0]), 1.702, 7.0),
                       swigluoai(torch.tensor([7.0]), torch.tensor([7.0]), 1.702, 7.0))  # fmt: skip


def test_swigluoai_gradient_is_zero_beyond_the_limits():
    gate = torch.tensor([8.0, 1.0], requires_grad=True)
    up = torch.tensor([1.0, -9.0], requires_grad=True)
    swigluoai(gate, up, 1.702, 7.0).sum().backward()
    assert gate.grad[0] == 0 and gate.grad[1] != 0
    assert up.grad[1] == 0 and up.grad[0] != 0


# ------------------------------------------------------------------------------- nvfp4_linear
def _exact_nvfp4(n: int, k: int, seed: int = 0):
    """NVFP4 weights whose dequantized values are exactly E2M1 values (scale 1, scale_2 1) and an
    integer x: every product and partial sum is exact in fp32, so any summation order agrees."""
    g = torch.Generator().manual_seed(seed)
    w = E2M1_VALUES[torch.randint(0, 16, (n, k), generator=g)]
    w.view(n, k // 16, 16)[..., 0] = 6.0  # block amax 6 -> block scale exactly 1
    t = quantize(w, 1.0)
    assert torch.equal(t.scales.float(), torch.ones(n, k // 16))
    x = torch.randint(-3, 4, (5, k), generator=g).float()
    return x, t


@pytest.mark.parametrize("n,tile_n", [(37, 8), (300, 128), (1, 4), (16, 16)])
def test_nvfp4_linear_tiles_over_n_equal_reference_exactly(n, tile_n):
    x, t = _exact_nvfp4(n, 64)
    y = nvfp4_linear(x, t.packed, t.scales, t.scale_2, tile_n=tile_n)
    assert torch.equal(y, nvfp4_linear_ref(x, t.packed, t.scales, t.scale_2))


@pytest.mark.parametrize("n,tile_n", [(37, 8), (513, 64)])
def test_nvfp4_linear_tiles_match_reference_on_random_data(n, tile_n):
    # Random fp32 data: BLAS may pick a different K-reduction order for a different N, so the
    # tiled result equals the reference up to fp32 rounding (the weights are identical: see above).
    g = torch.Generator().manual_seed(1)
    t = quantize(torch.randn(n, 128, generator=g))
    x = torch.randn(2, 3, 128, generator=g)
    y = nvfp4_linear(x, t.packed, t.scales, t.scale_2, tile_n=tile_n)
    assert y.shape == (2, 3, n)
    torch.testing.assert_close(y, nvfp4_linear_ref(x, t.packed, t.scales, t.scale_2), rtol=1e-5, atol=1e-5)


def test_nvfp4_linear_backward_matches_autograd_of_reference_and_passes_gradcheck():
    g = torch.Generator().manual_seed(2)
    t = quantize(torch.randn(37, 64, generator=g))
    x = torch.randn(6, 64, generator=g, requires_grad=True)
    nvfp4_linear(x, t.packed, t.scales, t.scale_2, tile_n=8).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    nvfp4_linear_ref(x_ref, t.packed, t.scales, t.scale_2).square().sum().backward()
    # Not bitwise: the forward's BLAS order differs per tile (dy = 2y inherits that) and dx is summed
    # over tiles in fp32; both are fp32 roundings of the same math.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    small = quantize(torch.randn(20, 32, generator=g))  # gradcheck cost grows with x.numel() * N
    x64 = torch.randn(2, 32, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a: nvfp4_linear(a, small.packed, small.scales, small.scale_2, tile_n=8), (x64,), fast_mode=True
    )


def test_nvfp4_linear_bf16_input_and_out_dtype():
    x, t = _exact_nvfp4(20, 32)
    y = nvfp4_linear(x.bfloat16(), t.packed, t.scales, t.scale_2, out_dtype=torch.float32, tile_n=8)
    assert y.dtype == torch.float32
    # Exact data: each fp32-accumulated dot product is exact, then rounded once to bf16 in both paths.
    assert torch.equal(y, nvfp4_linear_ref(x.bfloat16(), t.packed, t.scales, t.scale_2, torch.float32))


def test_nvfp4_linear_bad_inputs_raise_clear_errors():
    t = quantize(torch.randn(8, 32))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_linear(torch.randn(2, 24), t.packed[:, :12], t.scales[:, :1], t.scale_2)
    with pytest.raises(ValueError, match="K = 64"):
        nvfp4_linear(torch.randn(2, 64), t.packed, t.scales, t.scale_2)
    with pytest.raises(TypeError, match="uint8"):
        nvfp4_linear(x, t.packed.int(), t.scales, t.scale_2)
    with pytest.raises(ValueError, match="block scales"):
        nvfp4_linear(x, t.packed, t.scales.float(), t.scale_2)
    with pytest.raises(ValueError, match="scale_2"):
        nvfp4_linear(x, t.packed, t.scales, torch.ones(2))
    with pytest.raises(TypeError, match="x must be"):
        nvfp4_linear(x.long(), t.packed, t.scales, t.scale_2)
    with pytest.raises(ValueError, match="tile_n"):
        nvfp4_linear(x, t.packed, t.scales, t.scale_2, tile_n=0)


# ------------------------------------------------------------------------------- experts op
def test_grouped_nvfp4_experts_equal_float_experts_built_from_dequantized_weights():
    bank = ExpertBank.from_float(*_weights(), "nvfp4")
    float_bank = ExpertBank.from_float(*bank.dequantized_all(), "float")
    x, ids, weights = _routing(40)
    # Exact: every projection has N <= TILE_N, so nvfp4_linear does one matmul of the very same
    # operands the float path multiplies (multi-tile exactness is tested on exact data above).
    assert max(F, D) <= TILE_N
    assert torch.equal(moe_experts(x, ids, weights, bank), moe_experts(x, ids, weights, float_bank))


@pytest.mark.parametrize("fmt", ["float", "nvfp4", "mxfp8"])
def test_grouped_experts_match_per_token_loop_reference(fmt):
    bank = ExpertBank.from_float(*_weights(), fmt)
    x, ids, weights = _routing(24)
    y = moe_experts(x, ids, weights, bank)
    assert (ids != 5).all()  # an expert without tokens is part of the case
    torch.testing.assert_close(y, moe_experts_ref(x, ids, weights, bank), rtol=1e-5, atol=1e-6)


def test_grouped_experts_handle_zero_tokens_and_unused_experts():
    bank = ExpertBank.from_float(*_weights(), "nvfp4")
    y = moe_experts(torch.zeros(0, D), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), bank)
    assert y.shape == (0, D)
    x = torch.randn(3, D)
    ids = torch.tensor([[2, 6], [6, 2], [2, 6]])
    weights = torch.rand(3, K)
    torch.testing.assert_close(moe_experts(x, ids, weights, bank), moe_experts_ref(x, ids, weights, bank))


def test_experts_op_bad_inputs_raise_clear_errors():
    bank = ExpertBank.from_float(*_weights(), "float")
    x, ids, weights = _routing(4)
    with pytest.raises(ValueError, match=r"expert ids >= num_experts"):
        moe_experts(x, ids + E, weights, bank)
    with pytest.raises(ValueError, match=r"x must be \[T, 128\]"):
        moe_experts(x[:, :64], ids, weights, bank)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_experts(x, ids.float(), weights, bank)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_experts(x, ids, weights[:, :1], bank)


# ------------------------------------------------------------------------------- router
def _facts_router(x_TD, gate_ED, bias_E, top_k, scale):
    """docs/FACTS.md's router per token: pick by sigmoid + bias, weight by renormalised sigmoid x scale."""
    ids, weights = [], []
    for x_D in x_TD.double():
        scores = torch.sigmoid(gate_ED.double() @ x_D)
        chosen = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias_E[e].double()).item())[:top_k]
        total = sum(scores[e] for e in chosen)
        ids.append(chosen)
        weights.append([(scores[e] / total * scale).item() for e in chosen])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def test_router_chooses_by_biased_score_and_weights_by_unbiased_renormalised_scores():
    m = _moe("float")
    with torch.no_grad():
        m.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))  # big enough to flip choices
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(3))
    ids, weights, logits = m.route(x)
    ref_ids, ref_weights = _facts_router(x, m.gate.weight, m.e_score_correction_bias, K, 2.0)
    order = ids.argsort(dim=1)  # compare as sets: slot order does not matter
    ref_order = ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order).double(), ref_weights.gather(1, ref_order))
    torch.testing.assert_close(weights.sum(1), torch.full((64,), 2.0))
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32
    # The bias mattered: unbiased top-k differs for some tokens.
    unbiased = torch.sigmoid(logits).topk(K, dim=1).indices.sort(1).values
    assert not torch.equal(unbiased, ids.sort(1).values)


def test_router_runs_in_fp32_for_bf16_inputs():
    m = _moe("nvfp4")
    m.to(torch.bfloat16)
    assert m.gate.weight.dtype == torch.float32 and m.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(5, D)
    _, w_bf16, logits = m.route(x.bfloat16())
    assert logits.dtype == torch.float32 and w_bf16.dtype == torch.float32
    assert m(x.bfloat16()).dtype == torch.bfloat16


# ------------------------------------------------------------------------------- MoE block
def test_moe_block_matches_transformers_minimax_m3_port():
    tf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    tf_cfg = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")
    cfg = _cfg()
    hf = tf_cfg.MiniMaxM3VLTextConfig(
        hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
        shared_intermediate_size=cfg.shared_intermediate_size, routed_scaling_factor=2.0,
        swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, index_n_heads=2,
    )  # fmt: skip
    ref = tf.MiniMaxM3VLSparseMoeBlock(hf)
    m = _moe("float")
    with torch.no_grad():
        m.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
        ref.gate.weight.copy_(m.gate.weight)
        ref.gate.e_score_correction_bias.copy_(m.e_score_correction_bias)
        ref.experts.gate_up_proj.copy_(torch.cat([m.experts.w1_weight, m.experts.w3_weight], dim=1))
        ref.experts.down_proj.copy_(m.experts.w2_weight)
        s = m.shared_experts
        ref.shared_experts.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        ref.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    # Large inputs so the swigluoai clamps are active for some units.
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(4)) * 30
    out = m(x)
    assert out.shape == x.shape
    # transformers multiplies the summed routed output by 2.0, we fold it into the weights: rounding only.
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    # Shared expert: same math, but transformers fuses gate/up into one [2F, D] matmul whose BLAS
    # blocking may differ from two [F, D] ones, so only fp32 rounding separates them.
    torch.testing.assert_close(m.shared_experts(x), ref.shared_experts(x))


def test_forward_with_stats_counts_every_token_slot():
    m = _moe("nvfp4")
    out, stats = m.forward_with_stats(torch.randn(3, 5, D))
    assert out.shape == (3, 5, D)
    assert stats.tokens_per_expert_E.shape == (E,) and int(stats.tokens_per_expert_E.sum()) == 15 * K
    assert stats.router_logits_TE.shape == (15, E)


def test_mxfp8_experts_backward_matches_float_experts_from_dequantized_weights():
    bank = ExpertBank.from_float(*_weights(), "mxfp8")
    float_bank = ExpertBank.from_float(*bank.dequantized_all(), "float")
    x, ids, weights = _routing(16)
    grads = []
    for b in (bank, float_bank):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        moe_experts(xg, ids, wg, b).square().sum().backward()
        grads.append((xg.grad, wg.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)


def test_gradients_reach_input_and_router_but_nvfp4_experts_are_buffers():
    m = _moe("nvfp4")
    assert list(m.experts.parameters()) == []
    assert all(not b.requires_grad for b in m.experts.buffers())
    x = torch.randn(12, D, requires_grad=True)
    m(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and torch.isfinite(x.grad).all()
    assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0

    # Same gradient as the float bank built from the dequantized weights (fp32 tile accumulation only).
    m_float = _moe("float")
    m_float.experts = ExpertBank.from_float(*m.experts.dequantized_all(), "float")
    x2 = x.detach().clone().requires_grad_()
    m_float(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_frozen_float_bank_unchanged_after_optimizer_step_while_router_moves():
    m = _moe("float")
    before = {n: t.clone() for n, t in m.experts.named_parameters()}
    assert all(not p.requires_grad for p in m.experts.parameters())
    gate_before = m.gate.weight.detach().clone()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(16, D)).square().mean().backward()
    opt.step()
    for n, t in m.experts.named_parameters():
        assert t.grad is None and torch.equal(t, before[n]), n
    assert not torch.equal(m.gate.weight, gate_before)


def test_trainable_float_bank_receives_expert_gradients():
    bank = ExpertBank.from_float(*_weights(), "float", trainable=True)
    x, ids, weights = _routing(10)
    weights.requires_grad_()
    moe_experts(x, ids, weights, bank).sum().backward()
    used = ids.unique()
    assert bank.w1_weight.grad[used].abs().sum() > 0 and bank.w2_weight.grad is not None
    assert weights.grad is not None and weights.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="trainable"):
        ExpertBank(E, D, F, "nvfp4", trainable=True)


class _ToyExpertLoRA(nn.Module):
    """Rank-r delta per expert and projection: the shape of the later per-expert LoRA issue."""

    def __init__(self, bank: ExpertBank, r: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for proj, (n_out, n_in) in bank.proj_shapes().items():
            self.a[proj] = nn.Parameter(torch.randn(bank.num_experts, r, n_in, generator=g) * 0.1)
            self.b[proj] = nn.Parameter(torch.randn(bank.num_experts, n_out, r, generator=g) * 0.1)

    def forward(self, e, proj, x_MI):
        return x_MI @ self.a[proj][e].T @ self.b[proj][e].T


def test_lora_hook_changes_output_consistently_in_grouped_and_reference_paths():
    bank = ExpertBank.from_float(*_weights(), "nvfp4")
    x, ids, weights = _routing(12)
    y_base = moe_experts(x, ids, weights, bank)
    bank.lora = _ToyExpertLoRA(bank)
    assert "lora.a.w1" in dict(bank.named_parameters())
    y = moe_experts(x, ids, weights, bank)
    assert not torch.allclose(y, y_base)
    torch.testing.assert_close(y, moe_experts_ref(x, ids, weights, bank), rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    assert bank.lora.a["w2"].grad.abs().sum() > 0


# ------------------------------------------------------------------------------- storage and names
def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view of 1-byte storage, so fp8 codes compare exactly (NaN and -0 included)."""
    return t.view(torch.uint8) if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t


def test_nvfp4_bank_shapes_dtypes_and_shared_w1_w3_global_scale():
    bank = ExpertBank.from_float(*_weights(), "nvfp4")
    assert bank.w1_weight.shape == (E, F, D // 2) and bank.w1_weight.dtype == torch.uint8
    assert bank.w1_weight_scale.shape == (E, F, D // 16) and bank.w1_weight_scale.dtype == torch.float8_e4m3fn
    assert bank.w2_weight.shape == (E, D, F // 2) and bank.w2_weight_scale_2.shape == (E,)
    # vLLM serves the fused w13 with w1's scale_2: w1 and w3 must share it.
    assert torch.equal(bank.w1_weight_scale_2, bank.w3_weight_scale_2)
    assert bank.num_quantized_values() == 3 * E * D * F


@pytest.mark.parametrize("fmt", ["float", "nvfp4", "mxfp8"])
def test_expert_state_round_trips_through_load_expert_state(fmt):
    src = ExpertBank.from_float(*_weights(), fmt)
    dst = MoE(_cfg(), fmt=fmt).experts
    expected = {
        "float": {"w1.weight", "w2.weight", "w3.weight"},
        "nvfp4": {
            f"{p}.{s}" for p in ("w1", "w2", "w3") for s in ("weight", "weight_scale", "weight_scale_2")
        },
        "mxfp8": {f"{p}.{s}" for p in ("w1", "w2", "w3") for s in ("weight", "weight_scale_inv")},
    }[fmt]
    for e in range(E):
        state = src.expert_state(e)
        assert set(state) == expected
        dst.load_expert_state(e, {k: v for k, v in state.items() if k.startswith("w2.")})  # partial
        dst.load_expert_state(e, {k: v for k, v in state.items() if not k.startswith("w2.")})
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(_bits(a), _bits(b)), name
    for e in (0, E - 1):
        for got, want in zip(dst.dequantized(e), src.dequantized(e)):
            assert torch.equal(got, want)


def test_mxfp8_bank_accepts_vllm_scale_name_and_stores_what_quantize_mxfp8_gives():
    w1, w3, w2 = _weights()
    src = ExpertBank.from_float(w1, w3, w2, "mxfp8")
    state = {k.replace("weight_scale_inv", "weight_scale"): v for k, v in src.expert_state(3).items()}
    dst = ExpertBank(E, D, F, "mxfp8")
    dst.load_expert_state(3, state)
    assert torch.equal(dst.w3_weight_scale[3], src.w3_weight_scale[3])
    assert torch.equal(dst.dequantized(3)[0], dequantize_mxfp8(*quantize_mxfp8(w1[3])))


def test_load_expert_state_converts_float_and_mxfp8_experts_into_an_nvfp4_bank():
    w1, w3, w2 = _weights()
    want = ExpertBank.from_float(w1, w3, w2, "nvfp4")
    bank = ExpertBank(E, D, F, "nvfp4")
    bank.load_expert_state(2, ExpertBank.from_float(w1, w3, w2, "float").to(torch.bfloat16).expert_state(2))
    bf16 = ExpertBank.from_float(w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), "nvfp4")
    for k, v in bank.expert_state(2).items():  # bf16 weights quantize exactly as from_float's do
        assert torch.equal(_bits(v), _bits(bf16.expert_state(2)[k])), k
    mx = ExpertBank.from_float(w1, w3, w2, "mxfp8")
    bank.load_expert_state(4, mx.expert_state(4))
    from_mx = ExpertBank.from_float(*mx.dequantized_all(), "nvfp4")
    for k, v in bank.expert_state(4).items():
        assert torch.equal(_bits(v), _bits(from_mx.expert_state(4)[k])), k
    assert want.expert_state(4).keys() == bank.expert_state(4).keys()


def test_init_normal_fills_every_expert_in_the_bank_format():
    bank = ExpertBank(E, D, F, "nvfp4").init_normal_(0.02, torch.Generator().manual_seed(0))
    for e in (0, E - 1):
        w1, w3, w2 = bank.dequantized(e)
        assert 0.01 < w1.std() < 0.03 and w2.abs().sum() > 0 and not torch.equal(w1, w3)


def test_load_expert_state_rejects_wrong_names_shapes_and_dtypes():
    bank = ExpertBank(E, D, F, "nvfp4")
    good = ExpertBank.from_float(*_weights(), "nvfp4").expert_state(0)
    with pytest.raises(KeyError, match="unexpected keys"):
        bank.load_expert_state(0, {**good, "w4.weight": good["w1.weight"]})
    with pytest.raises(KeyError, match="weight_scale_2"):
        bank.load_expert_state(0, {k: v for k, v in good.items() if k != "w1.weight_scale_2"})
    with pytest.raises(ValueError, match=r"w1.weight is torch.uint8 \(64, 32\), expected"):
        bank.load_expert_state(0, {**good, "w1.weight": good["w1.weight"][:, :32]})
    with pytest.raises(ValueError, match=r"weight_scale is torch.float32.*expected torch.float8_e4m3fn"):
        bank.load_expert_state(0, {**good, "w1.weight_scale": good["w1.weight_scale"].float()})
    with pytest.raises(KeyError, match="W4A4 activation scales are not supported"):
        bank.load_expert_state(0, {**good, "w1.input_scale": torch.tensor(1.0)})
    with pytest.raises(KeyError, match="needs w1, w2 and w3 in one call"):
        bank.load_expert_state(0, {"w1.weight": torch.randn(F, D)})
    with pytest.raises(IndexError):
        bank.load_expert_state(E, good)
    with pytest.raises(ValueError, match="multiples of 16"):
        ExpertBank(E, 40, F, "nvfp4")
    with pytest.raises(ValueError, match="routed_experts='fp8'"):
        expert_format("fp8")


def test_module_dtype_cast_keeps_quantized_storage_and_moves_float_parts():
    m = _moe("nvfp4")
    before = {n: b.clone() for n, b in m.experts.named_buffers()}
    m.to(torch.float16)
    for n, b in m.experts.named_buffers():
        assert b.dtype == before[n].dtype and torch.equal(_bits(b), _bits(before[n])), n
    assert m.shared_experts.gate_proj.weight.dtype == torch.float16
    m_float = _moe("float").half()
    assert m_float.experts.w1_weight.dtype == torch.float16 and m_float.gate.weight.dtype == torch.float32


def test_dense_mlp_names_and_math():
    mlp = DenseMLP(D, 48, _cfg())
    assert set(dict(mlp.named_parameters())) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(4, D) * 20
    expected = mlp.down_proj(swigluoai(x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T, 1.702, 7.0))
    assert torch.equal(mlp(x), expected)
