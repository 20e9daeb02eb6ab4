"""Equivalence checks of the Triton decode kernels against their torch references.

Run in a subprocess with TRITON_INTERPRET=1 by tests/model/test_kernel_groups.py (CPU), so the
interpreter flag never leaks into the rest of the test session (Triton picks interpreter vs compiled
kernels when a kernel module is imported), and in-process on CUDA by the gpu-marked tests.
`python -m tests.model.kernel_cases GROUP` prints {check name: [ok, message]} as one JSON line.

Every check uses random data, ragged sequence lengths, several shapes, and outputs poisoned
(NaN or an impossible id) beforehand, so a missed write fails.
"""

import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

GROUPS = {
    "append": [
        "append_bytes_equal_kv_quantize",
        "kvcache_append_nvfp4_equals_torch_path",
        "fp8_dequant_bit_exact",
    ],
    "indexer": [
        "indexer_selects_like_reference",
        "indexer_scores_match_reference",
        "indexer_batch1_split_context",
        "indexer_c128_scores_and_selection_match_reference",
    ],
    "attention": [
        "attention_bf16_matches_reference",
        "attention_fp8_matches_emulated_reference",
        "attention_empty_selection_gives_zeros",
        "attention_v6_nvfp4_matches_reference",
    ],
    "noise": ["counter_noise_equals_the_torch_formula"],
    "lora": ["lora_delta_matches_torch", "lora_linear_inference_takes_the_kernel"],
    "norm": ["rms_norm_matches_torch", "rms_norm_rope_matches_torch", "add_rms_norm_equals_add_then_norm"],
    "moe": [
        "moe_grouping_kernel_equals_torch",
        "moe_matches_reference",
        "moe_large_groups_match_reference",
        "moe_v7_falls_back_to_the_tile_kernel",
        "linear_and_shared_expert_match",
        "gemv_v3_split_k_matches_reference",
    ],
    "moe_glue": [
        "router_selects_and_weights_like_torch",
        "router_ties_take_the_lower_expert_id",
        "swigluoai_bit_exact_with_torch",
        "moe_combine_bit_exact_with_torch",
    ],
}


def _ragged_tables(lens, page, width, gen):
    """Block tables [B, width] (int32, -1 padded) over shuffled pages, and the page count."""
    n_pages = sum(-(-n // page) for n in lens) + 3
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens):
        k = -(-n // page)
        table[b, :k] = perm[i : i + k].int()
        i += k
    return table, n_pages


def _rows(lens, rows_per, gen):
    """(seq_idx_T, positions_T): `rows_per` query rows per sequence at its last positions (verify-style)."""
    seq, pos = [], []
    for b, n in enumerate(lens):
        for r in range(rows_per):
            seq.append(b)
            pos.append(max(n - 1 - r, 0))
    return torch.tensor(seq, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


# ------------------------------------------------------------------------------------------ append
def _poisoned_pages(dtype, shape, gen):
    """Cache pages full of garbage (random bytes; NaN for float storage), so a missed write fails."""
    from model.kv_cache import _TORCH_STORAGE

    storage = _TORCH_STORAGE[dtype]
    if storage == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.full(shape, float("nan"), dtype=storage)


def _append_values(shape, x_dtype, gen):
    """Random rows over a wide range plus the edge cases: an all-zero block, a saturating value, tiny
    (fp8-subnormal) values; strided in the head dim's parent (a slice of a wider tensor)."""
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., : shape[-1]]
    x *= torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen))
    x.view(-1, shape[-1])[0, :16] = 0
    x.view(-1, shape[-1])[-1, 0] = 1e4
    x.view(-1, shape[-1])[-1, 1:4] = torch.tensor([3e-5, -6e-5, 1.2e-5])  # fp8 subnormals at scale 0.0071
    return x.to(x_dtype)


def _slot_patterns(n_slots, page, T, gen):
    """Slot mappings of T tokens (T + 2 < n_slots / 2): shuffled (non-contiguous pages and offsets),
    one contiguous run across a page boundary, and every other slot (strided)."""
    return {
        "shuffled": torch.randperm(n_slots, generator=gen)[:T],
        "contiguous": torch.arange(page - 2, page - 2 + T),
        "strided": torch.arange(T) * 2 + 1,
    }


def append_bytes_equal_kv_quantize(device):
    """kv_append (one launch: K, V, index key) stores the bytes of kv_append_ref (quantize_kv +
    scatter) for every K/V x index dtype pair, a full-attention layer (no index), an index-only call,
    several head dims / page sizes / slot patterns and float input dtypes."""
    from model.kernels.triton_kv_append import APPEND_DTYPES, kv_append
    from model.kv_cache import PagedIndex, PagedKV, kv_append_ref, stored_width

    gen = torch.Generator().manual_seed(1)
    shapes = [  # C, N, Ci, page, n_pages, T, x dtype
        (128, 4, 128, 16, 5, 6, torch.bfloat16),
        (32, 2, 48, 8, 4, 7, torch.float32),
        (48, 1, 32, 4, 6, 5, torch.float16),
    ]
    pairs = [(kv, ix) for kv in (*APPEND_DTYPES, None) for ix in (*APPEND_DTYPES, None) if kv or ix]
    for C, N, Ci, page, n_pages, T, x_dtype in shapes:
        k, v = _append_values((T, N, C), x_dtype, gen), _append_values((T, N, C), x_dtype, gen)
        idx_k = _append_values((T, Ci), x_dtype, gen)
        scales = [torch.tensor(s) for s in (0.0071, 0.013, 0.0029)]
        patterns = _slot_patterns(n_pages * page, page, T, gen)
        # Every dtype pair on shuffled slots; the other patterns on the engine's pairs (interpreter time).
        runs = [(pair, "shuffled") for pair in pairs]
        runs += itertools.product(
            [("nvfp4", "bf16"), ("nvfp4", "nvfp4"), ("nvfp4", None)], ["contiguous", "strided"]
        )
        for (kv_dtype, index_dtype), pattern in runs:
            slots = patterns[pattern]
            kv = index = None
            if kv_dtype:
                pages = _poisoned_pages(kv_dtype, (n_pages, 2 * N, page, stored_width(kv_dtype, C)), gen)
                kv = PagedKV(pages, kv_dtype, scales[0], scales[1], C)
            if index_dtype:
                pages = _poisoned_pages(index_dtype, (n_pages, page, stored_width(index_dtype, Ci)), gen)
                index = PagedIndex(pages, index_dtype, scales[2], Ci)
            want = [None if w is None else dataclasses.replace(w, pages=w.pages.clone()) for w in (kv, index)]
            dev = [None if g is None else _to_device(g, device) for g in (kv, index)]
            kv_append_ref(slots, want[0], k, v, want[1], idx_k)
            kv_append(slots.to(device), dev[0], k.to(device), v.to(device), dev[1], idx_k.to(device))
            for part, d, w in (("K/V", dev[0], want[0]), ("index", dev[1], want[1])):
                if w is not None and not torch.equal(
                    d.pages.cpu().view(torch.uint8), w.pages.view(torch.uint8)
                ):
                    n_bad = int((d.pages.cpu().view(torch.uint8) != w.pages.view(torch.uint8)).sum())
                    return False, (f"C={C} Ci={Ci} page={page} kv={kv_dtype} index={index_dtype} {pattern} "
                                   f"{x_dtype}: {n_bad} {part} bytes differ from quantize_kv")  # fmt: skip
    return True, ""


def _to_device(view, device):
    """A PagedKV / PagedIndex with its pages and scales on `device` (copies)."""
    scales = {f.name: getattr(view, f.name).to(device) for f in dataclasses.fields(view) if "scale" in f.name}
    return dataclasses.replace(view, pages=view.pages.to(device), **scales)


def _count_append_work(fn):
    """(Triton kv-append launches, torch ops that would launch a kernel) of fn()."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.kernels import triton_kv_append as tka

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    kernel, launches = tka._kv_append_kernel, []
    run = kernel.run

    def counted(*a, **k):
        launches.append(1)
        with torch.utils._python_dispatch._disable_current_modes():
            return run(*a, **k)

    kernel.run = counted
    try:
        with Ops() as ops:
            fn()
    finally:
        del kernel.run  # back to the class's method
    return len(launches), ops.names


def kvcache_append_nvfp4_equals_torch_path(device):
    """KVCache.append on an NVFP4 cache stores quantize_kv's bytes for K, V and index keys in every
    index dtype, in ONE kernel launch and no torch op (no slot // page, % page on the fused path); a
    full-attention layer is one launch too; a 4-over-6 part keeps its torch path beside one launch
    for the other part."""
    from model.config import ModelConfig
    from model.kv_cache import KVCache, quantize_kv

    cfg = ModelConfig.preset("tiny")
    gen = torch.Generator().manual_seed(3)
    T, N, C, Ci = 5, cfg.num_key_value_heads, cfg.head_dim, cfg.index_head_dim
    k, v = torch.randn(T, N, C, generator=gen), torch.randn(T, N, C, generator=gen)
    idx = torch.randn(T, Ci, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([0, 17, 18, 40, 95])
    page, off = slots // cfg.index_block_size, slots % cfg.index_block_size
    cases = [  # K/V dtype, index dtype, layer (0 is full attention)
        ("nvfp4", "nvfp4", 1), ("nvfp4", "fp8", 1), ("nvfp4", "bf16", 2), ("nvfp4", "fp32", 3),
        ("nvfp4", "bf16", 0), ("nvfp4", "nvfp4_4over6", 3), ("nvfp4_4over6", "nvfp4", 1),
    ]  # fmt: skip
    for kv_dtype, index_dtype, layer in cases:
        label = f"{kv_dtype} / {index_dtype} layer {layer}"
        cache = KVCache(cfg, num_pages=6, device=device, dtype=kv_dtype, index_dtype=index_dtype)
        cache.set_scales(layer, 0.01, 0.02, 0.03)
        is_sparse = cache.index[layer] is not None
        args = (slots.to(device), k.to(device), v.to(device), idx.to(device) if is_sparse else None)
        n_launch, ops = _count_append_work(functools.partial(cache.append, layer, *args))
        is_fused = "nvfp4_4over6" not in (kv_dtype, index_dtype if is_sparse else None)
        if n_launch != 1 or (is_fused and ops):
            return False, f"{label}: {n_launch} launches, torch ops {ops} (want 1 and none)"
        kv = cache.kv[layer].cpu()
        want_k = quantize_kv(k, kv_dtype, torch.tensor(0.01))
        want_v = quantize_kv(v, kv_dtype, torch.tensor(0.02))
        for n in range(N):
            if not torch.equal(kv[page, 2 * n, off], want_k[:, n]):
                return False, f"{label}: K bytes differ from quantize_kv"
            if not torch.equal(kv[page, 2 * n + 1, off], want_v[:, n]):
                return False, f"{label}: V bytes differ from quantize_kv"
        if is_sparse:
            want_i = quantize_kv(idx[:, None], index_dtype, torch.tensor(0.03))[:, 0]
            got_i = cache.index[layer].cpu()[page, off]
            if not torch.equal(got_i.view(torch.uint8), want_i.view(torch.uint8)):
                return False, f"{label}: index bytes differ from quantize_kv"
    return True, ""


def fp8_dequant_bit_exact(device):
    from model import nvfp4
    from model.kernels.triton_sparse_attention import nvfp4_rows_to_fp8_triton

    gen = torch.Generator().manual_seed(2)
    for C, R in [(128, 37), (32, 20)]:
        x = torch.randn(R, C, generator=gen) * torch.exp(2 * torch.randn(R, 1, generator=gen))
        for scale in (float(x.abs().max()) / 448, float(x.abs().max()) / 2688, 1.0):  # incl. saturation
            buf = nvfp4.kv_quantize(x, scale, check_finite=False)
            want, _ = nvfp4.kv_dequantize_fp8(buf, scale)
            got = nvfp4_rows_to_fp8_triton(buf.to(device)).cpu()
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                return (
                    False,
                    f"C={C} scale={scale}: {int((got.view(torch.uint8) != want.view(torch.uint8)).sum())}",
                )
    return True, ""


# ------------------------------------------------------------------------------------------ indexer
def _index_problem(dtype, C, page, lens, width, rows_per, gen, device, N=2):
    from model.kv_cache import PagedIndex, quantize_kv

    table, n_pages = _ragged_tables(lens, page, width, gen)
    keys = torch.randn(n_pages, page, 1, C, generator=gen)
    scale = torch.tensor(float(keys.abs().max()) / 448)
    pages = quantize_kv(keys, dtype, scale)[:, :, 0].contiguous()
    seq, pos = _rows(lens, rows_per, gen)
    q = torch.randn(len(seq), N, C, generator=gen).to(torch.bfloat16)
    cpu = (q, PagedIndex(pages, dtype, scale, C), table, seq, pos, torch.tensor(lens))
    dev = (q.to(device), PagedIndex(pages.to(device), dtype, scale.to(device), C), table.to(device),
           seq.to(device), pos.to(device), torch.tensor(lens, device=device))  # fmt: skip
    return cpu, dev


def indexer_selects_like_reference(device):
    from model.kernels.indexer import index_select_blocks, index_select_blocks_ref
    from model.kernels.triton_indexer import index_select_blocks_triton

    gen = torch.Generator().manual_seed(3)
    for dtype in ("nvfp4", "fp8", "bf16"):
        for C, page, lens, width, topk, local, init in [
            (32, 16, [5, 70, 33, 120], 8, 3, 1, 0),
            (64, 16, [100, 17, 64], 8, 4, 2, 1),
            (128, 16, [40, 70], 5, 3, 1, 0),  # C = 128: NVFP4 keys take the word / plane decode
        ]:
            cpu, dev = _index_problem(dtype, C, page, lens, width, 2, gen, device)
            kw = dict(topk=topk, local_blocks=local, init_blocks=init)
            want = index_select_blocks_ref(*cpu, **kw)
            q, ic, table, seq, pos, _ = dev
            poison = torch.full_like(want, -7).to(device)
            got = index_select_blocks_triton(
                q, ic.pages, ic.dtype, ic.scale, table, seq, pos, **kw, out_TNK=poison
            )
            if not torch.equal(got.cpu(), want):
                return False, f"{dtype} C={C}: selection differs\n{got.cpu()}\n{want}"
            if not torch.equal(index_select_blocks(*dev, **kw).cpu(), want):  # the dispatch point
                return False, f"{dtype} C={C}: index_select_blocks dispatch differs"
    return True, ""


def indexer_scores_match_reference(device):
    from model.kernels.triton_indexer import index_block_scores_triton
    from model.kv_cache import dequantize_kv, gather_pages

    gen = torch.Generator().manual_seed(4)
    for dtype in ("nvfp4", "fp8", "bf16"):
        cpu, dev = _index_problem(dtype, 32, 16, [70, 9], 6, 1, gen, device)
        q, ic, table, seq, pos, _lens = cpu
        got = index_block_scores_triton(dev[0], dev[1].pages, dtype, dev[1].scale, *dev[2:5]).cpu()
        for t in range(len(seq)):
            b, p = int(seq[t]), int(pos[t])
            keys = dequantize_kv(gather_pages(ic.pages, table[b], p + 1)[:, None], dtype, ic.scale, 32)[:, 0]
            s = q[t].float() @ keys.T
            nb = p // 16 + 1
            s = torch.nn.functional.pad(s, (0, nb * 16 - p - 1), value=float("-inf"))
            want = s.view(-1, nb, 16).amax(-1)
            if not torch.allclose(got[t, :, :nb], want, rtol=1e-5, atol=1e-5):
                return False, f"{dtype} row {t}: scores {got[t, :, :nb]} vs {want}"
    return True, ""


def indexer_batch1_split_context(device):
    from model.kernels.indexer import index_select_blocks_ref
    from model.kernels.triton_indexer import index_select_blocks_triton, plan_splits

    gen = torch.Generator().manual_seed(5)
    splits, _ = plan_splits(1, 32, torch.device(device))
    if splits < 2:
        return False, f"batch 1 must split the context, got {splits} split(s)"
    cpu, dev = _index_problem("nvfp4", 32, 16, [500], 32, 1, gen, device)
    kw = dict(topk=5, local_blocks=1, init_blocks=1)
    want = index_select_blocks_ref(*cpu, **kw)
    q, ic, table, seq, pos, _ = dev
    got = index_select_blocks_triton(q, ic.pages, ic.dtype, ic.scale, table, seq, pos, **kw)
    return bool(torch.equal(got.cpu(), want)), f"{got.cpu()} vs {want}"


def indexer_c128_scores_and_selection_match_reference(device):
    """NVFP4 keys at head dim 128 (the M3 index head; on CUDA the default "v7" runs the CUDA kernel,
    elsewhere the tile kernel): block scores equal the fp32 reference's within fp32 summation error for
    query rows of very different magnitudes (fp16 alone would overflow at 3e4 x 128 dims or flush
    1e-6), and selections equal the reference for the default and the byte-wise v2. Pages of 64
    tokens are the smallest v7 takes."""
    from model.kernels.indexer import index_select_blocks_ref
    from model.kernels.triton_indexer import index_block_scores_triton, index_select_blocks_triton

    gen = torch.Generator().manual_seed(11)
    for page, lens, q_mag in [(64, [170, 33], 1.0), (64, [100, 40], 3e4), (128, [150], 1e-6)]:
        cpu, dev = _index_problem("nvfp4", 128, page, lens, 8, 2, gen, device)
        q = (cpu[0].float() * q_mag).to(torch.bfloat16)
        cpu, dev = (q, *cpu[1:]), (q.to(device), *dev[1:])
        q, ic, table, seq, pos, _ = cpu
        for variant in ("v2", "v7"):
            got = index_block_scores_triton(dev[0], dev[1].pages, "nvfp4", dev[1].scale, *dev[2:5],
                                            variant=variant).cpu()  # fmt: skip
            ok, msg = _scores_close(got, q, ic, table, seq, pos, page)
            if not ok:
                return False, f"{variant} page={page} q x {q_mag}: {msg}"
        kw = dict(topk=3, local_blocks=1, init_blocks=1)
        want = index_select_blocks_ref(*cpu, **kw)
        for variant in ("v2", "v7"):
            poison = torch.full_like(want, -7).to(device)
            got = index_select_blocks_triton(dev[0], dev[1].pages, "nvfp4", dev[1].scale, *dev[2:5], **kw,
                                             out_TNK=poison, variant=variant)  # fmt: skip
            if not torch.equal(got.cpu(), want):
                return False, f"{variant} page={page} q x {q_mag}: selection differs\n{got.cpu()}\n{want}"
    return True, ""


def _scores_close(got, q, ic, table, seq, pos, page):
    """Block scores [T, N, blocks] vs the fp32 reference within fp32 summation error."""
    from model.kv_cache import dequantize_kv, gather_pages

    for t in range(len(seq)):
        b, p = int(seq[t]), int(pos[t])
        keys = dequantize_kv(gather_pages(ic.pages, table[b], p + 1)[:, None], "nvfp4", ic.scale, 128)[:, 0]
        s = q[t].float() @ keys.T
        nb = p // page + 1
        s = torch.nn.functional.pad(s, (0, nb * page - p - 1), value=float("-inf"))
        want = s.view(-1, nb, page).amax(-1)
        tol = 1e-5 * want.abs().max().item()
        if not torch.allclose(got[t, :, :nb], want, rtol=1e-5, atol=tol):
            return False, f"row {t}: scores {got[t, :, :nb]} vs {want}"
    return True, ""


# ------------------------------------------------------------------------------------------ attention
def _attn_problem(dtype, N, G, C, page, lens, width, K, rows_per, gen, device, empty_row=False, calib=448):
    """`calib`: the global scales are amax / calib (448: block scales <= 74.7; 2688, the weight rule:
    block scales up to 448, so e2m1 x scale reaches 2688)."""
    from model.kernels.cuda_attention import quantized_kv, visible_selections
    from model.kv_cache import PagedKV

    table, n_pages = _ragged_tables(lens, page, width, gen)
    kv = quantized_kv(n_pages, page, N, gen, calib, dtype, C)
    seq, pos = _rows(lens, rows_per, gen)
    q = torch.randn(len(seq), N * G, C, generator=gen).to(torch.bfloat16)
    sel = visible_selections(pos, N, K, page, gen)
    if empty_row:
        sel[0, 0] = -1
    cpu = (q, kv, table, seq, pos, torch.tensor(lens), sel)
    kv_dev = PagedKV(kv.pages.to(device), dtype, kv.k_scale.to(device), kv.v_scale.to(device), C)
    dev = (q.to(device), kv_dev, table.to(device), seq.to(device), pos.to(device), None, sel.to(device))
    return cpu, dev


def _run_attention(dev, sel, *, force_bf16_dot=False, sub_tile=None, variant="v6"):
    from model.kernels.triton_sparse_attention import sparse_attention_triton

    q, kv, table, seq, pos, _, _ = dev
    C = q.shape[-1]
    poison = torch.full_like(q, float("nan"))
    return sparse_attention_triton(q, kv, table, seq, pos, sel, softmax_scale=C**-0.5,
                                   force_bf16_dot=force_bf16_dot, out_THC=poison,
                                   sub_tile=sub_tile, variant=variant).float().cpu()  # fmt: skip


_ATTN_SHAPES = [  # N, G, C, page, lens, width, K, rows_per (small T forces split-K + merge)
    (2, 4, 32, 16, [5, 70, 33], 6, 3, 2),
    (1, 16, 64, 32, [100, 17], 4, 2, 1),
    (2, 8, 32, 16, [40, 90, 12, 77, 50, 33], 6, 2, 3),
]


def attention_bf16_matches_reference(device):
    from model.kernels.sparse_attention import sparse_attention, sparse_attention_ref

    gen = torch.Generator().manual_seed(6)
    for dtype in ("bf16", "fp8", "nvfp4"):
        for N, G, C, page, lens, width, K, rows in _ATTN_SHAPES:
            cpu, dev = _attn_problem(dtype, N, G, C, page, lens, width, K, rows, gen, device)
            # Dense walks (every block) for one format only: the walk does not depend on the format,
            # and the FP8 / v6 checks below run dense for fp8 and NVFP4 (keeps the file < 60 s on CPU).
            for is_dense in (False, True) if dtype == "bf16" else (False,):
                sel_c, sel_d = (None, None) if is_dense else (cpu[6], dev[6])
                want = sparse_attention_ref(*cpu[:6], sel_c, softmax_scale=C**-0.5).float()
                got = _run_attention(dev, sel_d, force_bf16_dot=True)
                err = (got - want).abs().max().item()
                if not err <= 0.02 * want.abs().max().item():  # bf16 rounding of q, P and the output
                    return False, f"{dtype} N={N} G={G} C={C} dense={is_dense}: max err {err}"
        if dtype == "bf16":  # the dispatch point takes the same kernel
            got = sparse_attention(*dev[:5], torch.tensor(lens, device=device), dev[6], softmax_scale=C**-0.5)
            want = sparse_attention_ref(*cpu, softmax_scale=C**-0.5)
            if not (got.float().cpu() - want.float()).abs().max() <= 0.02 * want.abs().max():
                return False, "sparse_attention dispatch differs from the reference"
    return True, ""


def attention_fp8_matches_emulated_reference(device):
    from model.kernels.sparse_attention import sparse_attention_ref
    from model.kernels.triton_sparse_attention import fp8_emulated, uses_fp8_dot

    gen = torch.Generator().manual_seed(7)
    for dtype in ("fp8", "nvfp4"):
        # The last shape: head dim 128 packed rows, which v6 takes for NVFP4; "v2" keeps them on the
        # FP8 path (the benchmarks' baseline).
        for N, G, C, page, lens, width, K, rows, sub, variant in [
            (1, 16, 64, 32, [100, 17], 4, 2, 1, None, "v6"),
            (2, 4, 32, 32, [70, 150, 5], 5, 3, 2, None, "v6"),
            (1, 8, 32, 64, [150, 40], 3, 2, 1, 32, "v6"),
            (1, 8, 128, 32, [70, 40], 3, 2, 1, None, "v2"),
        ]:
            assert uses_fp8_dot(dtype, C, page)
            cpu, dev = _attn_problem(dtype, N, G, C, page, lens, width, K, rows, gen, device)
            q_emul, kv_emul = fp8_emulated(cpu[0], cpu[1])
            for is_dense in (False, True):
                sel_c, sel_d = (None, None) if is_dense else (cpu[6], dev[6])
                want = sparse_attention_ref(q_emul, kv_emul, *cpu[2:6], sel_c, softmax_scale=C**-0.5).float()
                got = _run_attention(dev, sel_d, sub_tile=sub, variant=variant)  # sub < page: two tiles
                err = (got - want).abs().max().item()
                # Left: P rounded to e4m3 (relative 2^-4 per weight) and bf16 output rounding.
                if not err <= 0.04 * want.abs().max().item():
                    return False, f"{dtype} N={N} C={C} dense={is_dense}: max err {err} vs {want.abs().max()}"
    return True, ""


def attention_empty_selection_gives_zeros(device):
    gen = torch.Generator().manual_seed(8)
    for dtype in ("nvfp4", "bf16"):
        _, dev = _attn_problem(dtype, 2, 4, 32, 16, [70, 33], 6, 3, 2, gen, device, empty_row=True)
        got = _run_attention(dev, dev[6])
        if not (torch.equal(got[0, :4], torch.zeros_like(got[0, :4])) and torch.isfinite(got).all()):
            return False, f"{dtype}: group with no selected block must give zeros, got {got[0, :4]}"
    return True, ""


# M3 page (128) and G of the presets ("small": 8 / 4 = 2, "m3.1-flash": 64 / 4 = 16), head dim 128:
# N, G, lens (partially visible last blocks: 300 = 2 x 128 + 44, 129 = 128 + 1), table width,
# selected slots K, rows per sequence, sub-tile, a group with no selected block, walks (dense or not).
# Shape 1 has T x N = 24 work items (one split on the interpreter's 4 "SMs"), shape 2 has 2 (splits
# and `_merge_kernel`); sub-tile 64 walks each page in two K/V tiles.
_V6_SHAPES = [(4, 2, [300, 129, 70], 3, 2, 2, 64, True, (False, True)),
              (1, 16, [260, 200], 3, 2, 1, None, False, (False,))]  # fmt: skip


def _v6_cuda_shapes(device):
    """On CUDA, also a launch big enough for the autotuned kernel (every V6_CONFIGS entry)."""
    return [(4, 16, [3000] * 4, 24, 16, 2, None, False, (False,))] if device == "cuda" else []


def attention_v6_nvfp4_matches_reference(device):
    """v6 NVFP4 attention (head dim 128, packed rows; K and V decoded in registers into the dot
    operands) against the fp32 reference on the real NVFP4 inputs: its only roundings are P to e4m3
    (as the FP8 path; relative <= 2^-4 per normal weight, 2^-10 absolute below e4m3's normal range, errors of
    both signs) and the bf16 output, so it must be within 2^-5 of the output scale (measured on the
    interpreter: 1.0-1.6%; the deleted v5, which also rounded q, K and V to e4m3, was 5-7% off this
    reference, and 84-87% at amax / 2688, where it saturated). Caches calibrated at amax / 448 and at
    amax / 2688 (block scales up to 448: the FP8 path saturates e2m1 x scale at 448, v6 must
    not); split and dense walks, sub-tiles, -1 slots and a group with no selected block (zeros);
    outputs poisoned."""
    from model.kernels.sparse_attention import sparse_attention_ref

    gen = torch.Generator().manual_seed(14)
    for N, G, lens, width, K, rows, sub, empty, walks in _V6_SHAPES + _v6_cuda_shapes(device):
        for calib in (448, 2688):
            cpu, dev = _attn_problem("nvfp4", N, G, 128, 128, lens, width, K, rows, gen, device,
                                     empty_row=empty, calib=calib)  # fmt: skip
            for is_dense in walks:
                sel_c, sel_d = (None, None) if is_dense else (cpu[6], dev[6])
                want = sparse_attention_ref(*cpu[:6], sel_c, softmax_scale=128**-0.5).float()
                got = _run_attention(dev, sel_d, sub_tile=sub, variant="v6")
                scale = want.abs().max().item()
                err = (got - want).abs().max().item()
                if not (torch.isfinite(got).all() and err <= 2**-5 * scale):
                    return False, f"N={N} G={G} /{calib} dense={is_dense}: max err {err} ({scale})"
                if empty and not is_dense and not torch.equal(got[0, :G], torch.zeros_like(got[0, :G])):
                    return False, f"group with no selected block must give zeros, got {got[0, :G]}"
    return True, ""


# ------------------------------------------------------------------------------------------ norm
def rms_norm_matches_torch(device):
    """`rms_norm_triton` against `model.layers.norm.rms_norm`'s torch arithmetic: [R, D] rows, a
    [T, H, D] per-head slice of a packed projection (leading strides that do not collapse), a
    non-power-of-two width with a masked tail, several programs with a partial last one, and rows
    of very different scales; fp32 within 4e-6 relative, bf16 within one bf16 ulp (two roundings of
    values a few fp32 ulps apart)."""
    from model.kernels.triton_norm import rms_norm_triton
    from model.layers.norm import rms_norm

    gen = torch.Generator().manual_seed(22)
    packed = torch.randn(37, 3 * 4 * 64, generator=gen)
    cases = [
        ("rows", torch.randn(70, 96, generator=gen) * torch.exp(2 * torch.randn(70, 1, generator=gen))),
        ("heads of a packed qkv", packed[:, 4 * 64 : 8 * 64].view(37, 4, 64)),
        ("wide", torch.randn(3, 1536, generator=gen)),
    ]
    for name, x in cases:
        w = 0.1 * torch.randn(x.shape[-1], generator=gen)
        for dtype, tol in ((torch.float32, 4e-6), (torch.bfloat16, 2**-7 * 1.01)):  # bf16: one ulp
            xd = x.to(dtype)
            want = rms_norm(xd, w, 1e-6).float()  # CPU tensors: the torch path
            got = rms_norm_triton(xd.to(device), w.to(device), 1e-6)
            if got.shape != xd.shape or got.dtype != dtype or not got.is_contiguous():
                return False, f"{name} {dtype}: got {tuple(got.shape)} {got.dtype}"
            err = ((got.float().cpu() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
            if not err <= tol:
                return False, f"{name} {dtype}: max relative error {err} > {tol}"
    return True, ""


def rms_norm_rope_matches_torch(device):
    """`rms_norm_rope_triton` against `apply_rope(rms_norm(x))` in torch: q / k heads sliced from a
    packed projection, the index key's single head, partial rotation (R < D / 2) and full (2R = D),
    positions up to 2^19; fp32 within 1e-5 of each row's scale, bf16 within two bf16 ulps of it (the
    normed values are rounded to bf16 before rotating in both: that rounding and the output's can
    each land one ulp apart)."""
    from model.kernels.triton_norm import rms_norm_rope_triton
    from model.layers.norm import rms_norm
    from model.layers.rope import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(23)
    T = 21
    pos = torch.randint(0, 1 << 19, (T,), generator=gen)
    packed = torch.randn(T, 6 * 128, generator=gen)
    cases = [
        ("q heads", packed[:, : 4 * 128].view(T, 4, 128), 64),
        ("k head", packed[:, 4 * 128 : 5 * 128].view(T, 1, 128), 64),
        ("full rotation", torch.randn(T, 2, 32, generator=gen), 32),
    ]
    for name, x, rot in cases:
        cos, sin = rope_cos_sin(pos, rot, 5e6)
        w = 0.1 * torch.randn(x.shape[-1], generator=gen)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6 * 1.01)):
            xd = x.to(dtype)
            want = apply_rope(rms_norm(xd, w, 1e-6), cos, sin).float()
            got = rms_norm_rope_triton(xd.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device))
            if got.shape != xd.shape or got.dtype != dtype:
                return False, f"{name} {dtype}: got {tuple(got.shape)} {got.dtype}"
            err = ((got.float().cpu() - want).abs() / want.abs().amax(-1, keepdim=True)).max().item()
            if not err <= tol:
                return False, f"{name} {dtype}: max error {err} of the row scale > {tol}"
    return True, ""


def add_rms_norm_equals_add_then_norm(device):
    """`add_rms_norm_triton(x, y)` = (x + y, rms_norm_triton(x + y)) bit for bit: the stored sum is
    torch's add (rounded once to the stream's dtype) and the norm is the same launch's arithmetic on
    that rounded sum; x a strided view (a row slice of a wider buffer), a masked tail, several
    programs; fp32 and bf16; and the torch fallback `add_rms_norm` returns the same pair."""
    from model.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton
    from model.layers.norm import add_rms_norm

    gen = torch.Generator().manual_seed(24)
    wide = torch.randn(45, 160, generator=gen)
    cases = [("rows", torch.randn(70, 96, generator=gen)), ("strided rows", wide[:, 16:112]),
             ("wide", torch.randn(3, 1536, generator=gen))]  # fmt: skip
    for name, x in cases:
        y = torch.randn(x.shape, generator=gen) * 3
        w = 0.1 * torch.randn(x.shape[-1], generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            xd, yd, wd = x.to(dtype).to(device), y.to(dtype).to(device), w.to(device)
            total, normed = add_rms_norm_triton(xd, yd, wd, 1e-6)
            want_total = xd + yd
            want_normed = rms_norm_triton(want_total, wd, 1e-6)
            if not torch.equal(total, want_total):
                return False, f"{name} {dtype}: the stored sum differs from x + y"
            if not torch.equal(normed, want_normed):
                return False, f"{name} {dtype}: the norm of the sum differs from rms_norm_triton(x + y)"
            ref_total, ref_normed = add_rms_norm(xd.cpu(), yd.cpu(), w, 1e-6)  # not inference mode: torch
            err = (normed.float().cpu() - ref_normed.float()).abs() / ref_normed.float().abs().clamp_min(
                1e-30
            )
            tol = 4e-6 if dtype == torch.float32 else 2**-7 * 1.01
            if not torch.equal(ref_total, total.cpu()) or not err.max().item() <= tol:
                return False, f"{name} {dtype}: torch fallback differs (max rel. error {err.max().item()})"
    return True, ""


# ----------------------------------------------------------------------------------------- lora
def lora_delta_matches_torch(device):
    """`add_lora_delta_` against the fp64 value of y + ((x A^T) B^T) * scaling: within the two
    roundings torch's LoRALinear makes (the delta to y's dtype: u |delta|, then the sum: u |y + delta|,
    so u (|y| + 2 |delta|) with u = 2^-8 in bf16, 2^-20 allowed in fp32) plus fp32 summation order
    (2^-16 of the sum of |terms|); T over several
    token blocks, input features over several splits with a partial last one and a masked tail,
    ranks below tl.dot's 16 (padded), a masked output tail, a strided x."""
    from model.kernels.triton_lora import add_lora_delta_

    gen = torch.Generator().manual_seed(31)
    wide = torch.randn(70, 1400, generator=gen)
    cases = [
        (1, 96, 8, 72, None),
        (5, 1024, 32, 256, None),
        (37, 1300, 64, 130, None),
        (70, 1300, 16, 64, wide),
    ]
    for T, n_in, R, n_out, base in cases:
        x = base[:T, 50 : 50 + n_in] if base is not None else torch.randn(T, n_in, generator=gen)
        a = torch.randn(R, n_in, generator=gen) / n_in**0.5
        b = torch.randn(n_out, R, generator=gen)
        y0 = torch.randn(T, n_out, generator=gen)
        for dtype, tol in ((torch.bfloat16, 2**-8 * 1.01), (torch.float32, 2**-20)):
            xd, yd = x.to(dtype), y0.to(dtype)
            delta = (xd.double() @ a.double().T) @ b.double().T * 0.5
            want = yd.double() + delta
            got = add_lora_delta_(yd.to(device), xd.to(device), a.to(device), b.to(device), 0.5)
            if got.dtype != dtype or got.shape != (T, n_out):
                return False, f"T={T} I={n_in} R={R} {dtype}: got {tuple(got.shape)} {got.dtype}"
            # fp32 sums in any order: within 2^-16 of the sum of |terms| (I <= 1400 products, then R)
            bound = (xd.double().abs() @ a.double().abs().T) @ b.double().abs().T * 0.5
            allowed = tol * (yd.double().abs() + 2 * delta.abs()) + 2**-16 * bound
            excess = ((got.double().cpu() - want).abs() / allowed.clamp_min(1e-30)).max().item()
            if not excess <= 1.0:
                return False, f"T={T} I={n_in} R={R} O={n_out} {dtype}: error {excess:.2f}x the allowed"
    return True, ""


def lora_linear_inference_takes_the_kernel(device):
    """`LoRALinear` in inference mode (the engines) runs the kernel and agrees with its own torch ops
    (no inference mode) to bf16 rounding; a bf16 adapter keeps the torch ops (same bits both ways)."""
    from torch import nn

    from model.layers.lora import LoRALinear

    gen = torch.Generator().manual_seed(32)
    base = nn.Linear(200, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(96, 200, generator=gen) * 0.05)
    x = torch.randn(9, 200, generator=gen).to(torch.bfloat16)
    for adapter_dtype in (torch.float32, torch.bfloat16):
        lin = LoRALinear(base, r=8, alpha=16, dtype=adapter_dtype).to(device)
        with torch.no_grad():
            lin.lora_B.weight.copy_(torch.randn(96, 8, generator=gen))
        xd = x.to(device)
        with torch.no_grad():
            want = lin(xd)
        with torch.inference_mode():
            got = lin(xd)
        err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
        if adapter_dtype == torch.bfloat16 and not torch.equal(got, want):
            return False, "a bf16 adapter changed bits in inference mode (it should keep the torch ops)"
        if not err <= 2**-7:
            return False, f"{adapter_dtype} adapter: inference-mode output off by {err} relative"
    return True, ""


# ------------------------------------------------------------------------------------------ moe
def moe_grouping_kernel_equals_torch(device):
    """`_group_kernel` (one launch) gives exactly `group_by_expert_torch`'s rows and block experts:
    one slot, every slot on one expert, random routings with empty and overfull experts, group sizes
    that are and are not multiples of the block, both block sizes in use (16, `cuda_moe`'s 8), and
    the largest slot count it takes."""
    from model.kernels.triton_moe import GROUP_MAX_SLOTS, group_by_expert_torch, group_by_expert_triton

    gen = torch.Generator().manual_seed(21)
    cases = [(1, 8), (37, 1), (64, 128), (512, 16), (300, 7)]
    if device == "cuda":
        cases.append((GROUP_MAX_SLOTS, 256))
    for S, E in cases:
        for ids in (torch.randint(0, E, (S,), generator=gen), torch.full((S,), E - 1)):
            for rb in (16, 8):
                want = group_by_expert_torch(ids, E, block_rows=rb)
                got = group_by_expert_triton(ids.to(device), E, block_rows=rb)
                for name, w, g in zip(("rows", "block_expert"), want, got, strict=True):
                    if not torch.equal(w, g.cpu()):
                        bad = int((w != g.cpu()).sum())
                        return False, f"S={S} E={E} block={rb}: {name} differs in {bad} of {w.numel()}"
    return True, ""


def _bank(E, D, F, seed, device):
    from model.layers.moe import ExpertBank

    return ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, torch.Generator().manual_seed(seed)).to(device)


def _parts(bank, p):
    return (
        getattr(bank, f"{p}_weight"),
        getattr(bank, f"{p}_weight_scale"),
        getattr(bank, f"{p}_weight_scale_2"),
    )


def _moe_check(E, D, F, T, K, seed, device):
    from model.kernels.moe import moe_experts, moe_experts_ref
    from model.kernels.triton_moe import moe_nvfp4_triton

    gen = torch.Generator().manual_seed(seed)
    bank = _bank(E, D, F, seed, device)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    x, ids, w = x.to(device), ids.to(device), w.to(device)
    want = moe_experts_ref(x, ids, w, bank).float().cpu()
    poison = torch.full_like(x, float("nan"))
    parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
    kw = dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)
    got = moe_nvfp4_triton(x, ids, w, *parts, **kw, out_TD=poison)
    tol = 0.02 * want.abs().max().item()  # bf16 rounding of gate/up/act/output
    err = (got.float().cpu() - want).abs().max().item()
    if not err <= tol:
        return False, f"E={E} D={D} F={F} T={T} K={K}: max err {err} > {tol}"
    with torch.no_grad():
        err = (moe_experts(x, ids, w, bank).float().cpu() - want).abs().max().item()
    if not err <= tol:
        return False, f"moe_experts dispatch: max err {err} > {tol}"
    return True, ""


def moe_matches_reference(device):
    for E, D, F, T, K, seed in [(8, 128, 64, 5, 2, 0), (4, 64, 256, 3, 3, 1), (16, 256, 128, 1, 4, 2)]:
        ok, msg = _moe_check(E, D, F, T, K, seed, device)
        if not ok:
            return ok, msg
    return True, ""


def moe_large_groups_match_reference(device):
    return _moe_check(2, 64, 64, 40, 2, 3, device)  # ~40 tokens per expert: 3 row blocks each


def moe_v7_falls_back_to_the_tile_kernel(device):
    """`moe_nvfp4_triton`'s default (v7) outside the CUDA kernel's domain is the v2 tile kernel, bit
    for bit: F not a multiple of 64, and more than 8 slots per expert (36 slots on 4 experts); off
    CUDA (the interpreter) every shape. Inside the domain on CUDA: tests/model/test_cuda_moe.py."""
    from model.kernels.triton_moe import moe_nvfp4_triton

    gen = torch.Generator().manual_seed(5)
    for E, D, F, T, K in ((4, 64, 48, 3, 2), (4, 64, 64, 18, 2)):
        bank = _bank(E, D, F, 6, device)
        x = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
        w = torch.rand(T, K, generator=gen).to(device)
        parts = [_parts(bank, p) for p in ("w1", "w3", "w2")]
        kw = dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)
        v7, v2 = (moe_nvfp4_triton(x, ids, w, *parts, **kw, variant=v) for v in ("v7", "v2"))
        if not torch.equal(v7, v2):
            return False, f"E={E} D={D} F={F} T={T} K={K}: v7 differs from v2 where it should fall back"
    return True, ""


def linear_and_shared_expert_match(device):
    from model.kernels.moe import swigluoai
    from model.kernels.nvfp4_linear import nvfp4_linear_ref
    from model.kernels.triton_gemv import nvfp4_linear_triton
    from model.kernels.triton_moe import nvfp4_mlp_triton

    bank = _bank(1, 128, 64, 4, device)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(device)
    got = nvfp4_linear_triton(x, bank.w1_weight[0], bank.w1_weight_scale[0], bank.w1_weight_scale_2[0])
    want = nvfp4_linear_ref(x, bank.w1_weight[0], bank.w1_weight_scale[0], bank.w1_weight_scale_2[0])
    if not torch.equal(got.cpu(), want.cpu()):  # same bf16 weights, one bf16 dot, one rounding
        err = (got.float() - want.float()).abs().max().item()
        if err > 1e-2 * want.abs().max().item():
            return False, f"nvfp4_linear_triton: max err {err}"
    parts = [(p[0], s[0], c[0]) for p, s, c in (_parts(bank, n) for n in ("w1", "w3", "w2"))]
    got = nvfp4_mlp_triton(x, *parts, swiglu_alpha=1.702, swiglu_limit=7.0).float().cpu()
    d1, d3, d2 = bank.dequantized(0, torch.bfloat16)
    want = (swigluoai(x @ d1.T, x @ d3.T, 1.702, 7.0) @ d2.T).float().cpu()
    err = (got - want).abs().max().item()
    return err <= 0.02 * want.abs().max().item(), f"shared expert: max err {err}"


def gemv_v3_split_k_matches_reference(device):
    """The v3 split-K FMA GEMV, rows 1..4, against the reference
    and the exact fp32 product, with row (N) and K tails, 1-4 K splits (an empty last split included),
    poisoned outputs, and the split counters back at zero after every launch (the next launch
    depends on it)."""
    from model.kernels.nvfp4_linear import nvfp4_linear_ref
    from model.kernels.triton_gemv import _launch_gemv, nvfp4_linear_triton, split_counters
    from model.kernels.triton_moe import _parts

    gen = torch.Generator().manual_seed(10)
    shapes = [
        (48, 272, 1, 32, 64, 3),
        (48, 272, 2, 32, 128, 2),
        (32, 160, 3, 16, 32, 4),
        (16, 128, 4, 16, 64, 1),
    ]
    if device == "cuda":  # large enough for the autotuned launch (every config, SPLIT_K up to 4)
        shapes.append((1024, 2048, 4, None, None, None))
    for N, K, T, bn, bk, split_k in shapes:
        bank = _bank(1, K, N, int(torch.randint(0, 99, (1,), generator=gen)), device)
        args = (bank.w1_weight[0], bank.w1_weight_scale[0], bank.w1_weight_scale_2[0])
        x = (torch.randn(T, K, generator=gen) * 3).to(torch.bfloat16).to(device)
        want = nvfp4_linear_ref(x, *args).float().cpu()
        exact = x.float().cpu() @ bank.dequantized(0, torch.float32)[0].float().cpu().T
        w = _parts(args[0].unsqueeze(0), args[1].unsqueeze(0), args[2])
        got = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=device)
        if bn is None:
            got = nvfp4_linear_triton(x, *args)
        else:
            _launch_gemv(x, w, got, T, bn=bn, bk=bk, split_k=split_k)
        got = got.float().cpu()
        scale = exact.abs().max().item()
        err_exact = (got - exact).abs().max().item()
        err_ref = (got - want).abs().max().item()
        # bf16 output rounding (2^-8 relative) bounds the gap to the exact product; the reference
        # adds its own bf16 weight rounding on top.
        if not (torch.isfinite(got).all() and err_exact <= 2**-7 * scale and err_ref <= 1e-2 * scale):
            return False, (f"N={N} K={K} T={T} split={split_k}: err vs exact {err_exact}, "
                           f"vs ref {err_ref} ({scale})")  # fmt: skip
        if int(split_counters(torch.device(device), 1).abs().sum()) != 0:
            return False, f"N={N} K={K} T={T} split={split_k}: split counters not reset"
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16).to(device)
    bank = _bank(1, 128, 32, 5, device)
    args = (bank.w1_weight[0], bank.w1_weight_scale[0], bank.w1_weight_scale_2[0])
    v2 = nvfp4_linear_triton(x, *args, variant="v2").float().cpu()
    v3 = nvfp4_linear_triton(x, *args, variant="v3").float().cpu()
    if not (v3 - v2).abs().max() <= 2**-6 * v2.abs().max():
        return False, f"variant v3 vs v2: {(v3 - v2).abs().max()}"
    return True, ""


# ------------------------------------------------------------------------------------------ moe glue
def _poison_next_alloc(device, n_bytes):
    """On CUDA, hand the caching allocator a freed NaN / -1 block of this size, so an output the kernel
    forgets to write reads as garbage (CPU outputs are fresh allocations anyway)."""
    if device == "cuda":
        torch.full((max(n_bytes, 512) // 4,), float("nan"), device=device)


def _same_bits(got, want):
    """Exact equality as bit patterns (signed zeros told apart), NaNs matched as NaNs."""
    got, want = got.cpu(), want.cpu()
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[got.dtype]
    return torch.equal(got[~nan_g].view(ints), want[~nan_w].view(ints))


def _ulps(got, want):
    """Largest distance in units of the last place between finite same-dtype tensors (NaNs matched)."""
    got, want = got.cpu(), want.cpu()
    ok = ~(torch.isnan(got) | torch.isnan(want))
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[got.dtype]

    def ordered(t):  # monotone integer image of the floats (sign-magnitude -> two's complement)
        i = t[ok].view(ints).long()
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)

    return int((ordered(got) - ordered(want)).abs().max()) if ok.any() else 0


def _router_problem(T, E, gen, device, x_dtype=torch.float32):
    """Router logits of random tokens (through the fp32 GEMM, from x in x_dtype), the load-balancing
    bias at the scale of the scores' spread: tie-free in practice."""
    x = torch.randn(T, 64, generator=gen).to(x_dtype)
    w = torch.randn(E, 64, generator=gen) * 0.2
    logits = torch.nn.functional.linear(x.float(), w)
    bias = torch.randn(E, generator=gen) * 0.05
    return logits.to(device), bias.to(device)


def router_selects_and_weights_like_torch(device):
    """`router_topk_triton` against `select_experts_ref` on the same device: T = 1, 5, 64 tokens,
    E = 8, 32, 128 experts (one program and several, a masked row tail), K = 1 .. 8 (non-powers of
    two), logits from bf16 and fp32 tokens: the same expert ids in the same order, and weights within
    4 fp32 ulps: on CUDA the sigmoid is torch's bit for bit but torch's `sum(-1)` order depends on
    the shape (the kernel adds sequentially); on the CPU numpy's exp stands in for Sleef's."""
    from model.kernels.triton_router import router_topk_triton
    from model.layers.moe import select_experts_ref

    gen = torch.Generator().manual_seed(31)
    cases = [(T, E, K) for T in (1, 5, 64) for E in (8, 32, 128) for K in (2, 4, 8) if K <= E]
    cases += [(5, 8, 1), (5, 32, 3), (64, 128, 6), (3, 256, 8)]
    for T, E, K in cases:
        for x_dtype in (torch.bfloat16, torch.float32):
            logits, bias = _router_problem(T, E, gen, device, x_dtype)
            scale = 2.0 if K != 3 else 2.5
            want_ids, want_w = select_experts_ref(logits, bias, K, scale)
            _poison_next_alloc(device, T * K * 8)
            ids, w = router_topk_triton(logits, bias, K, scale)
            tag = f"T={T} E={E} K={K} x {x_dtype}"
            if (ids.dtype, w.dtype, ids.shape, w.shape) != (torch.int64, torch.float32, (T, K), (T, K)):
                return False, f"{tag}: got {ids.dtype} {tuple(ids.shape)}, {w.dtype} {tuple(w.shape)}"
            if not torch.equal(ids.cpu(), want_ids.cpu()):
                bad = int((ids.cpu() != want_ids.cpu()).any(-1).sum())
                return False, f"{tag}: expert ids differ in {bad} of {T} rows"
            if not _ulps(w, want_w) <= 4:
                return False, f"{tag}: weights {_ulps(w, want_w)} ulps from torch"
    return True, ""


def router_ties_take_the_lower_expert_id(device):
    """Deliberate ties of the biased score (equal logits and bias): across the K boundary, among the
    chosen and across all E. The kernel follows its rule: descending key, equal keys by ascending id
    (a stable descending sort). torch.topk: on CUDA it selects the same set of experts here (checked);
    on the CPU its heap may take any of the tied experts (not checked: the rule is documented in
    `select_experts`)."""
    from model.kernels.triton_router import router_topk_triton

    for E, K in ((8, 2), (32, 4), (128, 4), (128, 8)):
        logits = torch.zeros(4, E)
        logits[0, [1, 3, 5]] = 1.0  # three-way tie at the top, K = 2 of them chosen (or all + others)
        logits[1] = 0.5  # every expert tied
        logits[2, [E - 1, 0]] = 2.0  # tied pair at the top, then one more, then E - 3 tied zeros
        logits[2, E // 2] = 1.5
        logits[3, [2, 6]] = torch.tensor(-1.0)  # a tie at the bottom; the rest tied above it
        bias = torch.zeros(E)
        bias[7] = -0.25  # expert 7 ranks below its tied peers whatever its logit
        key = torch.sigmoid(logits) + bias
        rule = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :K]
        ids, w = router_topk_triton(logits.to(device), bias.to(device), K, 2.0)
        if not torch.equal(ids.cpu(), rule):
            return False, f"E={E} K={K}: ids {ids.cpu().tolist()} break the tie rule {rule.tolist()}"
        s = torch.sigmoid(logits).gather(1, rule)
        if not (w.cpu() - s / s.sum(-1, keepdim=True) * 2.0).abs().max() <= 1e-6:
            return False, f"E={E} K={K}: weights {w.cpu().tolist()}"
        if device == "cuda":
            _, t_ids = torch.topk(key.to(device), K, dim=-1)
            if not torch.equal(t_ids.sort(-1).values.cpu(), rule.sort(-1).values):
                return False, f"E={E} K={K}: torch.topk took {t_ids.cpu().tolist()}, the rule {rule.tolist()}"
    return True, ""


def swigluoai_bit_exact_with_torch(device):
    """`swigluoai_triton` against `swigluoai_ref` on the same device, bf16 and fp32, [T, F] for
    T = 1, 5, 64 and F = 64, 256, 1000 (a masked tail), values past +-limit, exactly +-limit, huge
    negatives (sigmoid 0: signed zeros), inf and NaN, and a limit that bf16 cannot hold: bit for bit
    on CUDA; on the CPU, where the interpreter's exp (numpy) and torch's (Sleef) differ by a few fp32
    ulps in ~40% of values, within 8 fp32 ulps, and in bf16 within 2 ulps in <= 2% of the values.
    Also the dispatch: `swigluoai` takes the kernel in inference mode and the torch formula outside."""
    from model.kernels.moe import swigluoai, swigluoai_ref
    from model.kernels.triton_swiglu import swigluoai_triton

    gen = torch.Generator().manual_seed(32)
    for T in (1, 5, 64):
        for F in (64, 256, 1000):
            gate = torch.randn(T, F, generator=gen) * 4
            up = torch.randn(T, F, generator=gen) * 4
            special = torch.tensor([7.0, -7.0, 7.5, -1e30, float("inf"), float("-inf"), float("nan"), 0.0])
            gate.view(-1)[: special.numel()] = special
            up.view(-1)[-special.numel() :] = special
            for dtype in (torch.bfloat16, torch.float32):
                for alpha, limit in ((1.702, 7.0), (1.0, 7.01)):
                    g, u = gate.to(dtype).to(device), up.to(dtype).to(device)
                    want = swigluoai_ref(g, u, alpha, limit)
                    _poison_next_alloc(device, g.numel() * g.element_size())
                    got = swigluoai_triton(g, u, alpha, limit)
                    tag = f"T={T} F={F} {dtype} alpha={alpha} limit={limit}"
                    if got.dtype != dtype or got.shape != g.shape:
                        return False, f"{tag}: got {got.dtype} {tuple(got.shape)}"
                    if device == "cuda":
                        if not _same_bits(got, want):
                            return False, f"{tag}: not bit-exact, {_ulps(got, want)} ulps"
                    else:  # numpy's exp and Sleef's are each within ~2 fp32 ulps, not the same ones
                        n_diff = int((got != want).sum() - torch.isnan(want).sum())
                        ulp_tol, frac = (2, 0.02) if dtype == torch.bfloat16 else (8, 1.0)
                        if not (_ulps(got, want) <= ulp_tol and n_diff <= frac * got.numel()):
                            return False, f"{tag}: {n_diff} values differ, up to {_ulps(got, want)} ulps"
    g, u = gate.to(device), up.to(device)
    with torch.inference_mode():
        fast = swigluoai(g, u, 1.702, 7.0)
    if not _same_bits(fast, swigluoai_triton(g, u, 1.702, 7.0)):
        return False, "swigluoai in inference mode did not take the kernel"
    if not _same_bits(swigluoai(g, u, 1.702, 7.0), swigluoai_ref(g, u, 1.702, 7.0)):
        return False, "swigluoai outside inference mode did not take the torch formula"
    return True, ""


def _sum_4_accumulators(y_TKD):
    """torch's CUDA `sum(1)` order for K < 16 slots, in torch ops: slot k into accumulator k % 4."""
    acc = [torch.zeros_like(y_TKD[:, 0]) for _ in range(4)]
    for k in range(y_TKD.shape[1]):
        acc[k % 4] = acc[k % 4] + y_TKD[:, k]
    return ((acc[0] + acc[1]) + acc[2]) + acc[3]


def moe_combine_bit_exact_with_torch(device):
    """`moe_combine` (slot sum, rounding, + shared expert: one launch) against the torch ops it
    replaces (`moe_combine_ref`) on the same device, bit for bit: T = 1, 5, 64, D = 64 and 1000 (a
    masked tail), K = 1, 2, 3, 4, 8, bf16 and fp32 out, with and without the shared term, slots of
    mixed signs and scales (the sum order shows), a poisoned out. On the CPU, whose `sum(1)` adds
    sequentially, K = 8 is checked against torch's CUDA order emulated instead. Then the wiring:
    `moe_experts(..., shared=f)` on the engine path passes f's output to the combine launch and
    equals `moe_experts(...) + f(x)` exactly."""
    from unittest import mock

    from model.kernels import triton_moe, triton_moe_combine
    from model.kernels.moe import moe_experts
    from model.kernels.triton_moe_combine import moe_combine, moe_combine_ref

    gen = torch.Generator().manual_seed(33)
    for T in (1, 5, 64):
        for D in (64, 1000):
            for K in (1, 2, 3, 4, 8):
                y = torch.randn(T * K, D, generator=gen) * torch.exp(3 * torch.randn(T * K, 1, generator=gen))
                y = y.to(device)
                for dtype in (torch.bfloat16, torch.float32):
                    for shared in (None, torch.randn(T, D, generator=gen).to(dtype).to(device)):
                        tag = f"T={T} D={D} K={K} {dtype} shared={shared is not None}"
                        if device == "cuda" or K <= 4:
                            want = moe_combine_ref(y, K, torch.empty_like(y[:T], dtype=dtype), shared)
                        else:
                            want = _sum_4_accumulators(y.view(T, K, D)).to(dtype)
                            want = want if shared is None else want + shared
                        out = torch.full((T, D), float("nan"), dtype=dtype, device=device)
                        got = moe_combine(y, K, out, shared)
                        if got.data_ptr() != out.data_ptr() or not _same_bits(got, want):
                            return False, f"{tag}: {_ulps(got, want)} ulps from torch"
    gen = torch.Generator().manual_seed(34)
    bank = _bank(8, 128, 64, 5, device)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)]).to(device)
    w = torch.rand(5, 2, generator=gen).to(device)
    shared = torch.randn(5, 128, generator=gen).to(torch.bfloat16).to(device)
    took_shared = []  # per combine launch: whether it was given the shared term

    def combine(y_SD, top_k, out_TD, shared_TD=None):
        took_shared.append(shared_TD is not None)
        return moe_combine(y_SD, top_k, out_TD, shared_TD)

    with (
        torch.inference_mode(),
        mock.patch.object(triton_moe, "moe_combine", combine),
        mock.patch.object(triton_moe_combine, "moe_combine", combine),  # cuda_moe imports it at call time
    ):
        fused = moe_experts(x, ids, w, bank, shared=lambda x_TD: shared)
        apart = moe_experts(x, ids, w, bank) + shared
    if took_shared != [True, False]:
        return False, f"combine launches given the shared term: {took_shared}, want [True, False]"
    if not _same_bits(fused, apart):
        return False, f"moe_experts with shared: {_ulps(fused, apart)} ulps from the separate add"
    return True, ""


# -------------------------------------------------------------------------------------------- noise
def counter_noise_equals_the_torch_formula(device):
    """The Triton counter-noise kernel gives its torch twin's uniforms bit for bit and its
    exponentials within 1e-6 for the active rows (shared, negative and 2^62-sized seeds; ragged widths
    across the block size), and the fill (0 / 1) in the inactive rows, whatever its memory held."""
    from model.kernels.triton_noise import counter_noise_triton
    from rollout.native.sampler import CounterRNG, counter_noise_torch

    for n in (1, 264, 3000):
        rngs = [CounterRNG(s) for s in (3, 2**62 + 5, -7, 0)]
        keys = torch.tensor([r.next_key() for r in rngs], dtype=torch.int64)
        for exponential, active in ((False, [True, True, True, True]), (True, [False, True, False, True]),
                                    (False, [True, False, True, False])):  # fmt: skip
            is_active = torch.tensor(active)
            want = counter_noise_torch(keys, is_active, n, exponential)
            if device == "cuda":  # the caching allocator then hands that block to the kernel's output
                torch.full((4, n), float("nan"), device=device)  # freed at once: poisons that block
            got = counter_noise_triton(keys.to(device), is_active.to(device), n, exponential).cpu()
            same = torch.equal(got, want) if not exponential else torch.allclose(got, want, rtol=1e-6, atol=0)
            if not same:
                return False, f"n={n} exponential={exponential}: {int((got != want).sum())} values differ"
            fill = 1.0 if exponential else 0.0
            if not bool((got[~is_active] == fill).all() and (want[~is_active] == fill).all()):
                return False, f"n={n} exponential={exponential}: inactive rows are not {fill}"
            if not bool((want[is_active] != fill).all()):
                return False, f"n={n}: an active row holds the fill"
    return True, ""


def run_interpreted(group: str, timeout_s: float = 300.0) -> dict[str, list]:
    """Run one group on the CPU under TRITON_INTERPRET=1 in a fresh interpreter process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.model.kernel_cases", group], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"kernel_cases {group} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_group(group: str, device: str = "cpu", only: str | None = None) -> dict[str, list]:
    out = {}
    for name in GROUPS[group] if only is None else [only]:
        try:
            ok, msg = globals()[name](device)
        except Exception as exc:  # reported to the parent test with its message
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        out[name] = [bool(ok), "" if ok else str(msg)[:2000]]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_group(sys.argv[1])))
