"""The batched torch paths of the paged ops equal their loop references (the spec)."""

from __future__ import annotations

import pytest
import torch

from model.kernels.indexer import index_select_blocks_ref, index_select_blocks_torch
from model.kernels.sparse_attention import sparse_attention_ref, sparse_attention_torch
from model.kv_cache import PagedIndex, PagedKV, quantize_kv

PAGE, N, G, C = 4, 2, 3, 32


def ragged_batch(dtype: str, seed: int = 0):
    """Three sequences of ragged lengths in shuffled pages; stale slots past each length hold NaN
    (fp32) or random bytes, which must never be read."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([9, 3, 14])
    n_pages = 12
    k = torch.randn(n_pages, PAGE, N, C, generator=gen)
    v = torch.randn(n_pages, PAGE, N, C, generator=gen)
    idx = torch.randn(n_pages, PAGE, 1, C, generator=gen)
    scale = torch.tensor(0.05)
    kv = torch.stack(
        [quantize_kv(k, dtype, scale), quantize_kv(v, dtype, scale)], dim=3
    )  # [P, page, N, 2, X]
    pages = kv.flatten(2, 3).transpose(1, 2).contiguous()  # [P, 2N, page, X] with slot 2*head + side
    index_pages = quantize_kv(idx, dtype, scale)[:, :, 0]
    perm = torch.randperm(n_pages, generator=gen)
    tables = torch.full((3, 4), -1)
    tables[0, :3], tables[1, :1], tables[2, :4] = perm[:3], perm[3:4], perm[4:8]
    if dtype == "fp32":  # poison the stale tail of sequence 0's last page
        pages[perm[2], :, 1:] = float("nan")
    # Tokens: a prefill chunk of sequence 2, one decode token each for 0 and 1, interleaved.
    seq = torch.tensor([2, 0, 2, 1, 2, 2])
    pos = torch.tensor([8, 8, 9, 2, 12, 13])
    paged = PagedKV(pages, dtype, scale, scale, C)
    index = PagedIndex(index_pages, dtype, scale, C)
    return paged, index, tables, seq, pos, lens, gen


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("sparse", [False, True])
def test_batched_sparse_attention_equals_reference(dtype, sparse):
    paged, _index, tables, seq, pos, lens, gen = ragged_batch(dtype)
    q = torch.randn(len(seq), N * G, C, generator=gen)
    selected = None
    if sparse:
        selected = torch.tensor([[[3, 0], [3, 1]], [[2, -1], [2, 0]], [[2, -1], [0, 2]],
                                 [[0, -1], [0, -1]], [[3, 1], [3, 2]], [[3, 2], [3, -1]]])  # fmt: skip
    args = (q, paged, tables, seq, pos, lens, selected)
    want = sparse_attention_ref(*args, softmax_scale=C**-0.5)
    got = sparse_attention_torch(*args, softmax_scale=C**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize(("topk", "local", "init"), [(2, 1, 0), (3, 1, 1), (4, 2, 0)])
def test_batched_indexer_equals_reference(dtype, topk, local, init):
    _paged, index, tables, seq, pos, lens, gen = ragged_batch(dtype, seed=1)
    q = torch.randn(len(seq), N, C, generator=gen)
    kw = {"topk": topk, "local_blocks": local, "init_blocks": init}
    want = index_select_blocks_ref(q, index, tables, seq, pos, lens, **kw)
    got = index_select_blocks_torch(q, index, tables, seq, pos, lens, **kw)
    assert torch.equal(got, want)
