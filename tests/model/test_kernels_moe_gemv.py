"""Routed MoE decode v6 (grouped split-K FMA GEMV, model/kernels/triton_moe_gemv.py) vs the references.

CPU: the checks below run in one subprocess under TRITON_INTERPRET=1 (the flag must be set before
Triton kernels are imported, and must not leak into other test modules); each pytest test reads one
check's result. GPU (-m gpu): the same checks compiled on CUDA, in process, plus the M3-width decode
batch (64 tokens, 128 experts top-4) through the autotuned launches.
`python -m tests.model.test_kernels_moe_gemv [check ...]` prints {check: [ok, message]} as JSON.

Every check poisons the output and the kernels' scratch buffers (act, y) with NaN beforehand
(`POISON_INTERMEDIATES`), so a row left unwritten shows up as a NaN.

Tolerances: v6 multiplies by the unrounded weights e2m1 * s * scale_2 (exact fp32 products, fp32 sums)
and rounds gate, up, act and y to bf16 where the tile kernel does. Against `emulated`, the same
roundings applied to fp32 products with the fp32 weights, only the summation order differs, so the
two agree to a bf16 rounding of the output (a flipped bf16 rounding of gate/up/act moves an output by
~2^-8 of one term): 2^-7 of the max. Against `moe_experts_ref` and the v2 tile kernel, whose weights
are bf16(e2m1 * s * scale_2) (< 2^-8 relative per weight), 0.02 of the max, the tile kernel's own
tolerance against the reference (tests/model/kernel_cases.py).
"""

import json
import sys

import pytest
import torch

from tests.model.interpreted import run_module_interpreted, run_named

CHECKS = [
    "v6_matches_references_across_shapes_and_tiles",
    "blocks_of_1_to_4_rows_and_multi_block_experts_match",
    "split_k_sums_equal_one_split_and_counters_return_to_zero",
    "v6_dispatch_takes_gemv_for_decode_and_tile_kernel_above",
]
GPU_CHECKS = ["m3_width_decode_batch_matches_torch_and_v2"]


def _bank(E, D, F, seed, device):
    from model.layers.moe import ExpertBank

    return ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, torch.Generator().manual_seed(seed)).to(device)


def _parts(bank, p):
    return tuple(getattr(bank, f"{p}_{s}") for s in ("weight", "weight_scale", "weight_scale_2"))


def _kw(bank):
    return dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)


def emulated(x, ids, w, bank):
    """What v6 computes, in torch: fp32 weights (exact dequantization), gate / up / act / y rounded to
    bf16 as the kernels round them, y times the router weight in fp32, the K slots summed in fp32."""
    from model.kernels.moe import swigluoai

    bf = torch.bfloat16
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            w1, w3, w2 = (m.float().cpu() for m in bank.dequantized(int(ids[t, k]), torch.float32))
            x_1D = x[t : t + 1].float().cpu()
            gate, up = (x_1D @ w1.T).to(bf).float(), (x_1D @ w3.T).to(bf).float()
            act = swigluoai(gate, up, bank.swiglu_alpha, bank.swiglu_limit).to(bf).float()
            out[t] += (act @ w2.T).to(bf).float()[0] * w[t, k].float().cpu()
    return out.to(bf).float()


def _counters_zero(device) -> bool:
    from model.kernels.triton_gemv import split_counters

    return int(split_counters(torch.device(device), 1).abs().sum()) == 0


def _run_v6(x, ids, w, bank, tile):
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv

    poison = torch.full_like(x, float("nan"))
    parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
    return moe_nvfp4_gemv(x, ids, w, *parts, **_kw(bank), out_TD=poison, tile=tile)


def _compare(x, ids, w, bank, tile, label, with_v2=True):
    """v6 vs the emulation, `moe_experts_ref` and (with_v2) the v2 tile kernel; counters back at 0."""
    from model.kernels.moe import moe_experts_ref
    from model.kernels.triton_moe import moe_nvfp4_triton

    got = _run_v6(x, ids, w, bank, tile).float().cpu()
    if not torch.isfinite(got).all():
        return False, f"{label}: {int((~torch.isfinite(got)).sum())} outputs not written (NaN)"
    if not _counters_zero(x.device.type):
        return False, f"{label}: split counters not back at 0"
    want = emulated(x, ids, w, bank)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    if not err <= 2**-7 * scale:
        return False, f"{label}: vs emulation max err {err} > 2^-7 x {scale}"
    ref = moe_experts_ref(x, ids, w, bank).float().cpu()
    err = (got - ref).abs().max().item()
    if not err <= 0.02 * scale:
        return False, f"{label}: vs moe_experts_ref max err {err} > 0.02 x {scale}"
    if with_v2:
        v2 = moe_nvfp4_triton(x, ids, w, *(_parts(bank, p) for p in ("w1", "w3", "w2")), **_kw(bank))
        err = (got - v2.float().cpu()).abs().max().item()
        if not err <= 0.02 * scale:
            return False, f"{label}: vs v2 tile kernel max err {err} > 0.02 x {scale}"
    return True, ""


def _routing(T, E, K, gen, device):
    """Distinct experts per token (as the router picks them), random weights."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids.to(device), torch.rand(T, K, generator=gen).to(device)


def v6_matches_references_across_shapes_and_tiles(device):
    """Several (E, D, F, T, K): T = 1 (most experts without tokens), a ragged K = 3 batch with every
    expert over 4 slots (2-3 blocks each), K tails (D = 96 with a 64-wide step), 1-3 K splits."""
    from model.kernels.triton_moe_gemv import MoeGemvTile

    cases = [
        (8, 128, 64, 6, 2, MoeGemvTile(block_n=32, block_k=128, block_k34=64, split_k=1)),
        (16, 64, 48, 1, 4, MoeGemvTile(block_n=16, block_k=64, block_k34=32, split_k=2)),
        (4, 96, 32, 9, 3, MoeGemvTile(block_n=32, block_k=64, block_k34=32, split_k=3)),
    ]
    gen = torch.Generator().manual_seed(0)
    for i, (E, D, F, T, K, tile) in enumerate(cases):
        bank = _bank(E, D, F, i, device)
        x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).to(device)
        ids, w = _routing(T, E, K, gen, device)
        ok, msg = _compare(x, ids, w, bank, tile, f"E={E} D={D} F={F} T={T} K={K} {tile}")
        if not ok:
            return ok, msg
    return True, ""


def blocks_of_1_to_4_rows_and_multi_block_experts_match(device):
    """Top-1 routing with expert counts 1, 2, 3, 4, 5, 0, 7, 9 (shuffled over tokens): row blocks with
    every valid-row count 1..4 (each a separately compiled loop), an expert without tokens, experts of
    2 and 3 blocks. Large activations push gate / up into the swigluoai clamps."""
    from model.kernels.triton_moe_gemv import MoeGemvTile

    counts = [1, 2, 3, 4, 5, 0, 7, 9]
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1).to(device)
    T = ids.shape[0]
    bank = _bank(len(counts), 64, 32, 7, device)
    x = (torch.randn(T, 64, generator=gen) * 8).to(torch.bfloat16).to(device)
    w = torch.rand(T, 1, generator=gen).to(device)
    tile = MoeGemvTile(block_n=32, block_k=64, block_k34=32, split_k=1)
    return _compare(x, ids, w, bank, tile, "top-1 counts 1..9", with_v2=False)


def split_k_sums_equal_one_split_and_counters_return_to_zero(device):
    """K splits (2, 3 with an empty last split, 4) give the one-split result up to fp32 summation
    order, and every launch leaves the tile counters at 0 (the next launch depends on it)."""
    from model.kernels.triton_moe_gemv import MoeGemvTile

    gen = torch.Generator().manual_seed(2)
    E, D, F, T, K = 6, 64, 64, 5, 2
    bank = _bank(E, D, F, 11, device)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).to(device)
    ids, w = _routing(T, E, K, gen, device)
    base = _run_v6(x, ids, w, bank, MoeGemvTile(64, 32, 32, split_k=1)).float().cpu()
    scale = base.abs().max().item()
    for split_k in (2, 3, 4):  # in = 64 at a 32-wide step: splits 3 and 4 leave empty K ranges
        got = _run_v6(x, ids, w, bank, MoeGemvTile(64, 32, 32, split_k=split_k)).float().cpu()
        if not _counters_zero(device):
            return False, f"split_k={split_k}: split counters not back at 0"
        err = (got - base).abs().max().item()
        if not (torch.isfinite(got).all() and err <= 2**-7 * scale):
            return False, f"split_k={split_k}: vs one split max err {err} (max {scale})"
    return True, ""


def v6_dispatch_takes_gemv_for_decode_and_tile_kernel_above(device):
    """moe_nvfp4_triton(variant="v6") is moe_nvfp4_gemv (bit for bit) while T * K <= 4 E, and the v2
    tile kernel above (prefill-sized batches); the default stays v2; unknown variants raise."""
    from model.kernels.triton_moe import moe_nvfp4_triton
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv

    gen = torch.Generator().manual_seed(3)
    E, D, F, K = 4, 64, 32, 2
    bank = _bank(E, D, F, 5, device)
    parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
    for T, takes_gemv in ((8, True), (9, False)):  # T * K = 16 = 4 E: gemv; 18: tile kernel
        x = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(device)
        ids, w = _routing(T, E, K, gen, device)
        v6 = moe_nvfp4_triton(x, ids, w, *parts, **_kw(bank), variant="v6")
        v2 = moe_nvfp4_triton(x, ids, w, *parts, **_kw(bank))
        direct = moe_nvfp4_gemv(x, ids, w, *parts, **_kw(bank))
        if not torch.equal(v6, direct if takes_gemv else v2):
            return False, f"T={T}: variant v6 should run {'the gemv' if takes_gemv else 'the tile kernel'}"
    try:
        moe_nvfp4_triton(x, ids, w, *parts, **_kw(bank), variant="v5")
    except ValueError as exc:
        return "variant" in str(exc), f"unclear error: {exc}"
    return False, "variant='v5' did not raise"


def m3_width_decode_batch_matches_torch_and_v2(device):
    """M3 widths (D 6144, F 3072, 128 experts top-4), 64 tokens and 1 token, random NVFP4 codes and
    scales, autotuned launches: v6 vs the torch NVFP4 path and the v2 tile kernel within 0.02 of the
    max, every output written, counters at 0."""
    from model.kernels.moe import moe_experts_torch
    from model.kernels.triton_moe import moe_nvfp4_triton
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv
    from model.layers.moe import ExpertBank

    E, D, F, K = 128, 6144, 3072, 4
    torch.manual_seed(0)
    bank = ExpertBank(E, D, F, "nvfp4", device=device)
    for p, (n_out, n_in) in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
        packed = torch.randint(0, 256, (E, n_out, n_in // 2), dtype=torch.uint8, device=device)
        getattr(bank, f"{p}_weight").copy_(packed)
        scales = (torch.rand(E, n_out, n_in // 16, device=device) * 60 + 4).to(torch.float8_e4m3fn)
        getattr(bank, f"{p}_weight_scale").copy_(scales)
        getattr(bank, f"{p}_weight_scale_2").fill_(2e-4)
    parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
    for T in (64, 1):
        x = torch.randn(T, D, device=device).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)])
        w = torch.rand(T, K, device=device)
        got = moe_nvfp4_gemv(x, ids, w, *parts, **_kw(bank), out_TD=torch.full_like(x, float("nan"))).float()
        if not torch.isfinite(got).all() or not _counters_zero(device):
            return False, f"T={T}: unwritten outputs or split counters not at 0"
        want = moe_experts_torch(x, ids, w, bank).float()
        v2 = moe_nvfp4_triton(x, ids, w, *parts, **_kw(bank)).float()
        scale = want.abs().max().item()
        err, err_v2 = (got - want).abs().max().item(), (got - v2).abs().max().item()
        if not (err <= 0.02 * scale and err_v2 <= 0.02 * scale):
            return False, f"T={T}: max err vs torch {err}, vs v2 {err_v2} (max {scale})"
    return True, ""


def run_checks(names, device="cpu"):
    from model.kernels import triton_moe_gemv

    triton_moe_gemv.POISON_INTERMEDIATES = True
    return run_named(globals(), names, device)


def run_interpreted(names, timeout_s=600.0):
    return run_module_interpreted("tests.model.test_kernels_moe_gemv", names, timeout_s)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_interpreted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_moe_gemv_under_interpreter(interpreted, check):
    ok, msg = interpreted[check]
    assert ok, msg


def test_moe_gemv_tile_rejects_bad_sizes():
    pytest.importorskip("triton")
    from model.kernels.triton_moe_gemv import MoeGemvTile

    bad = [dict(block_n=24), dict(block_k=64, block_k34=128), dict(block_k=16, block_k34=16), dict(split_k=0)]
    for kw in bad:
        with pytest.raises(ValueError, match="MoeGemvTile"):
            MoeGemvTile(**kw)


def test_moe_gemv_rejects_mismatched_weights_with_the_field_name():
    pytest.importorskip("triton")
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv

    bank = _bank(2, 32, 16, 0, "cpu")
    parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="w2 packed"):
        moe_nvfp4_gemv(x, ids, w, parts[0], parts[1], parts[0], **_kw(bank))
    with pytest.raises(ValueError, match="bf16"):
        moe_nvfp4_gemv(x.float(), ids, w, *parts, **_kw(bank))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", CHECKS + GPU_CHECKS)
def test_moe_gemv_on_cuda(check):
    ok, msg = run_checks([check], "cuda")[check]
    assert ok, msg


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_checks(sys.argv[1:] or CHECKS)))
