"""Triton NVFP4 MoE training kernels (forward + backward, expert LoRA) vs autograd through the reference.

CPU: the checks below run in one subprocess under TRITON_INTERPRET=1 (the flag must be set before
Triton kernels are imported, and must not leak into other test modules); each pytest test reads one
check's result. GPU (-m gpu): the same checks compiled on CUDA, in process.
`python -m tests.model.test_kernels_train_moe [check ...]` prints {check: [ok, message]} as JSON.

Every check poisons the kernels' scratch buffers with NaN (`POISON_INTERMEDIATES`), so a row or tile
left unwritten shows up as a NaN output or gradient.

Tolerances: at fp32 the kernels multiply the same dequantized weights (e2m1 * fl(s * scale_2), exact
in fp32) as `moe_experts_ref`, so only the summation order differs: relative error ~1e-6 of the max
magnitude (K <= 128 terms of size ~1 in fp32: a few ulps), checked at 1e-4. At bf16 both sides round
gate, up, act, y and the gradients to bf16 (2^-9 relative each) at different points (the kernel adds
LoRA deltas before rounding, the reference after), so they agree to a few bf16 ulps: 3e-2 of the max.
"""

import json
import sys

import pytest
import torch

from tests.model.interpreted import run_module_interpreted, run_named

CHECKS = [
    "fp32_no_lora_grads_equal_autograd_of_reference",
    "fp32_lora_grads_equal_autograd_of_reference",
    "unrouted_experts_and_padding_rows_stay_exact",
    "bf16_lora_matches_reference_within_bf16_rounding",
    "dispatch_uses_kernel_and_no_grad_reaches_nvfp4_buffers",
    "expert_shard_with_whole_adapter_uses_its_own_experts_factors",
]
SLOW_CHECKS = ["fp32_lora_large_groups_block64"]


def _problem(E, D, F, T, K, R, seed, dtype, device):
    from model.layers.lora import ExpertLoRA
    from model.layers.moe import ExpertBank

    gen = torch.Generator().manual_seed(seed)
    bank = ExpertBank(E, D, F, "nvfp4").init_normal_(0.1, gen)
    if R:
        bank.lora = ExpertLoRA(bank, R, 2.0 * R, generator=gen)
        with torch.no_grad():  # B starts at zero: randomise it so every LoRA term is exercised
            for p in ("w1", "w2", "w3"):
                getattr(bank.lora, p).lora_B.copy_(
                    torch.randn(getattr(bank.lora, p).lora_B.shape, generator=gen) * 0.1
                )
    bank = bank.to(device)
    x = (torch.randn(T, D, generator=gen) * 5).to(dtype)  # gate/up reach the +-7 clamps: masks exercised
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return bank, x.to(device), ids.to(device), w.to(device)


def _parts(bank, p):
    return (
        getattr(bank, f"{p}_weight"),
        getattr(bank, f"{p}_weight_scale"),
        getattr(bank, f"{p}_weight_scale_2"),
    )


def _lora_args(bank):
    if bank.lora is None:
        return None, []
    L = bank.lora
    factors = [L.w1.lora_A, L.w1.lora_B, L.w3.lora_A, L.w3.lora_B, L.w2.lora_A, L.w2.lora_B]
    return (*factors, L.scaling), factors


def _compare(E, D, F, T, K, R, seed, dtype, device, rtol, block_m=16):
    from model.kernels.moe import moe_experts_ref
    from model.kernels.triton_moe_train import moe_nvfp4_train

    bank, x, ids, w = _problem(E, D, F, T, K, R, seed, dtype, device)
    lora, factors = _lora_args(bank)
    go = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 7)).to(device)
    results = []
    for use_kernel in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if use_kernel:
            y = moe_nvfp4_train(
                xi,
                ids,
                wi,
                _parts(bank, "w1"),
                _parts(bank, "w3"),
                _parts(bank, "w2"),
                lora,
                swiglu_alpha=bank.swiglu_alpha,
                swiglu_limit=bank.swiglu_limit,
                block_m=block_m,
            )
        else:
            y = moe_experts_ref(xi, ids, wi, bank)
        grads = torch.autograd.grad((y.float() * go).sum(), [xi, wi, *factors])
        results.append([y, *grads])
    names = ["y", "dx", "dw", "dA1", "dB1", "dA3", "dB3", "dA2", "dB2"]
    for name, got, want in zip(names, *results):
        got, want = got.float().cpu(), want.float().cpu()
        if not torch.isfinite(got).all():
            return False, f"{name}: non-finite values (unwritten scratch?)"
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        if not err <= rtol * max(scale, 1e-6):
            return (
                False,
                f"E={E} D={D} F={F} T={T} K={K} R={R} {dtype}: {name} max err {err} > {rtol} * {scale}",
            )
    return True, ""


def fp32_no_lora_grads_equal_autograd_of_reference(device):
    return _compare(4, 64, 32, 9, 2, 0, 0, torch.float32, device, 1e-4)


def fp32_lora_grads_equal_autograd_of_reference(device):
    return _compare(4, 64, 64, 11, 3, 4, 1, torch.float32, device, 1e-4)


def unrouted_experts_and_padding_rows_stay_exact(device):
    # 8 experts, 3 tokens, top-1: most experts get nothing, every used block is mostly padding.
    return _compare(8, 32, 32, 3, 1, 2, 2, torch.float32, device, 1e-4)


def bf16_lora_matches_reference_within_bf16_rounding(device):
    return _compare(4, 64, 32, 10, 2, 4, 3, torch.bfloat16, device, 3e-2)


def fp32_lora_large_groups_block64(device):
    return _compare(4, 128, 64, 96, 2, 8, 4, torch.float32, device, 1e-4, block_m=64)


def dispatch_uses_kernel_and_no_grad_reaches_nvfp4_buffers(device):
    from model.kernels.moe import moe_experts, moe_experts_torch

    bank, x, ids, w = _problem(
        4, 64, 32, 7, 2, 4, 5, torch.bfloat16 if device == "cuda" else torch.float32, device
    )
    xi = x.clone().requires_grad_()
    y = moe_experts(xi, ids, w, bank)
    if "NVFP4MoETrain" not in type(y.grad_fn).__name__:
        return False, f"moe_experts with grad took {type(y.grad_fn).__name__}, not the Triton training kernel"
    y.float().square().sum().backward()
    frozen = [b for n, b in bank.named_buffers() if n.startswith(("w1", "w2", "w3"))]
    if any(b.requires_grad or b.grad is not None for b in frozen):
        return False, "an NVFP4 buffer received a gradient"
    lora_grads = [p.grad for p in bank.lora.parameters()]
    if any(g is None or not torch.isfinite(g).all() or g.abs().max() == 0 for g in lora_grads):
        return False, "a LoRA factor got no (or a non-finite) gradient"
    with torch.no_grad():
        want = moe_experts_torch(x, ids, w, bank).float()
    err = (y.detach().float() - want).abs().max().item()
    tol = (1e-4 if x.dtype == torch.float32 else 3e-2) * want.abs().max().item()
    return err <= tol, f"dispatch vs torch path: max err {err} > {tol}"


def expert_shard_with_whole_adapter_uses_its_own_experts_factors(device):
    """An expert-parallel shard (experts 2..4 of 6) keeps the whole layer's adapter behind a local ->
    global offset: the kernel must read global experts 2..4's factors, and their gradients must land
    in those rows of the whole tensors."""
    from model.kernels.moe import moe_experts, moe_experts_torch
    from model.parallel.expert_parallel import shard_expert_bank

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bank, x, _, w = _problem(6, 64, 32, 7, 2, 4, 6, dtype, device)
    shard = shard_expert_bank(bank, 2, 5)
    ids = torch.stack([torch.randperm(3, generator=torch.Generator().manual_seed(t))[:2] for t in range(7)])
    ids = ids.to(device)
    y = moe_experts(x.clone().requires_grad_(), ids, w, shard)
    if "NVFP4MoETrain" not in type(y.grad_fn).__name__:
        return False, f"the shard took {type(y.grad_fn).__name__}, not the Triton training kernel"
    y.float().square().sum().backward()
    got = {n: p.grad.clone() for n, p in bank.lora.named_parameters()}
    bank.lora.zero_grad()
    want_y = moe_experts_torch(x, ids + 2, w, bank)
    want_y.float().square().sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, got_t, want_t in [("y", y.detach(), want_y.detach())] + [
        (n, got[n], p.grad) for n, p in bank.lora.named_parameters()
    ]:
        err = (got_t.float() - want_t.float()).abs().max().item()
        if not err <= tol * max(want_t.float().abs().max().item(), 1e-6):
            return False, f"{name}: shard kernel vs whole-bank torch path max err {err}"
    return True, ""


def run_checks(names, device="cpu"):
    from model.kernels import triton_moe_train

    triton_moe_train.POISON_INTERMEDIATES = True
    return run_named(globals(), names, device)


def run_interpreted(names, timeout_s=600.0):
    return run_module_interpreted("tests.model.test_kernels_train_moe", names, timeout_s)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_interpreted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_moe_train_kernel_under_interpreter(interpreted, check):
    ok, msg = interpreted[check]
    assert ok, msg


@pytest.mark.slow
@pytest.mark.parametrize("check", SLOW_CHECKS)
def test_moe_train_kernel_large_case_under_interpreter(check):
    pytest.importorskip("triton")
    ok, msg = run_interpreted([check])[check]
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", CHECKS + SLOW_CHECKS)
def test_moe_train_kernel_on_cuda(check):
    ok, msg = run_checks([check], "cuda")[check]
    assert ok, msg


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_checks(sys.argv[1:] or CHECKS + SLOW_CHECKS)))
