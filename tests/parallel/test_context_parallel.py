"""Decode-context parallel indexer and attention on 1, 2 and 4 gloo processes against the
single-rank ops (`index_select_blocks_ref`, `sparse_attention_ref`) on the unsharded cache.

Ragged sequences (1 to 50 tokens, pages of 4 in shuffled page order), several query positions per
sequence, fp32 and NVFP4 caches, and integer-valued keys (many tied block scores) check the
tie-breaking. Top-k selections must be identical (same blocks, same order); outputs within 1e-5."""

import pytest
import torch

from model.kernels.indexer import index_select_blocks_ref, select_blocks
from model.kernels.sparse_attention import sparse_attention_ref
from model.kv_cache import PagedIndex, PagedKV, quantize_kv
from model.parallel.context_parallel import (
    DCPLayout,
    dcp_index_local_topk,
    dcp_index_select_blocks,
    dcp_sparse_attention,
    merge_attention_partials,
    merge_topk_candidates,
    shard_pages,
)
from model.parallel.groups import ParallelGroups, launch_local

PAGE, N, H, C = 4, 2, 4, 16
SEQ_LENS = [1, 7, 13, 33, 50]
SELECT = [(3, 1, 0), (4, 1, 1), (2, 2, 1), (16, 1, 0), (5, 0, 2), (1, 2, 2)]  # (topk, local, init)
SCALE = C**-0.5
CACHES = [("fp32", False), ("nvfp4", False), ("fp32", True)]  # (dtype, integer-valued keys: ties)


def _case(dtype: str, ties: bool):
    """A paged cache of SEQ_LENS sequences and T query tokens (varlen: each sequence's last position
    plus a few earlier ones). Returns (index, kv, block_tables_BP, seq_idx_T, positions_T, seq_lens_B,
    index_q_TNC, q_THC)."""
    gen = torch.Generator().manual_seed(3 + ties)
    nb = [-(-n // PAGE) for n in SEQ_LENS]
    P = sum(nb) + 3  # a few spare pages
    perm = torch.randperm(P, generator=gen)
    table = torch.full((len(nb), max(nb)), -1, dtype=torch.long)
    used = 0
    for b, n in enumerate(nb):
        table[b, :n] = perm[used : used + n]
        used += n

    def rand(*shape):
        x = torch.randn(*shape, generator=gen)
        return x.round().clamp(-2, 2) if ties else x

    keys = rand(P, PAGE, 1, C)
    k, v = rand(P, PAGE, N, C), rand(P, PAGE, N, C)
    if dtype == "nvfp4":
        scales = [t.abs().amax() / 2688 for t in (keys, k, v)]
    else:
        scales = [torch.tensor(1.0)] * 3
    index = PagedIndex(quantize_kv(keys, dtype, scales[0])[:, :, 0], dtype, scales[0], C)
    sk, sv = quantize_kv(k, dtype, scales[1]), quantize_kv(v, dtype, scales[2])  # [P, page, N, X]
    pages = torch.stack([sk, sv], dim=3).flatten(2, 3).transpose(1, 2).contiguous()  # [P, 2N, page, X]
    kv = PagedKV(pages, dtype, scales[1], scales[2], C)
    seq_idx, pos = [], []
    for b, n in enumerate(SEQ_LENS):
        chosen = sorted({n - 1, *torch.randint(0, n, (3,), generator=gen).tolist()})
        seq_idx += [b] * len(chosen)
        pos += chosen
    T = len(pos)
    index_q = rand(T, N, C)
    q = rand(T, H, C)
    return index, kv, table, torch.tensor(seq_idx), torch.tensor(pos), torch.tensor(SEQ_LENS), index_q, q


def _dcp_worker() -> dict:
    groups = ParallelGroups.build()
    layout = DCPLayout(groups.rank, groups.world_size, PAGE)
    out = {}
    for dtype, ties in CACHES:
        index, kv, table, seq_idx, pos, lens, index_q, q = _case(dtype, ties)
        index_pages, index_table = shard_pages(index.pages, table, lens, layout)
        kv_pages, kv_table = shard_pages(kv.pages, table, lens, layout)
        assert torch.equal(index_table, kv_table)
        local_index = PagedIndex(index_pages, index.dtype, index.scale, index.head_dim)
        local_kv = PagedKV(kv_pages, kv.dtype, kv.k_scale, kv.v_scale, kv.head_dim)
        for topk, local, init in SELECT:
            sel = dcp_index_select_blocks(
                index_q, local_index, index_table, seq_idx, pos, lens,
                topk=topk, local_blocks=local, init_blocks=init, group=groups.ep_group,
            )  # fmt: skip
            att = dcp_sparse_attention(
                q, local_kv, kv_table, seq_idx, pos, lens, sel, softmax_scale=SCALE, group=groups.ep_group
            )
            out[(dtype, ties, topk, local, init)] = {"selected": sel, "out": att}
        dense = dcp_sparse_attention(q, local_kv, kv_table, seq_idx, pos, lens, None, softmax_scale=SCALE,
                                     group=groups.ep_group)  # fmt: skip
        out[(dtype, ties, "dense")] = {"out": dense, "local_pages": index_pages.shape[0]}
    return out


@pytest.fixture(scope="module")
def world2():
    return launch_local(_dcp_worker, 2)


@pytest.fixture(scope="module")
def world4():
    return launch_local(_dcp_worker, 4)


def _check(results: list[dict]) -> None:
    for dtype, ties in CACHES:
        index, kv, table, seq_idx, pos, lens, index_q, q = _case(dtype, ties)
        for topk, local, init in SELECT:
            want = index_select_blocks_ref(
                index_q, index, table, seq_idx, pos, lens, topk=topk, local_blocks=local, init_blocks=init
            )
            want_out = sparse_attention_ref(q, kv, table, seq_idx, pos, lens, want, softmax_scale=SCALE)
            for res in results:
                got = res[(dtype, ties, topk, local, init)]
                assert torch.equal(got["selected"], want), (dtype, ties, topk, local, init)
                torch.testing.assert_close(got["out"], want_out, atol=1e-5, rtol=0)
        dense = sparse_attention_ref(q, kv, table, seq_idx, pos, lens, None, softmax_scale=SCALE)
        for res in results:
            torch.testing.assert_close(res[(dtype, ties, "dense")]["out"], dense, atol=1e-5, rtol=0)


def test_dcp_2_ranks_topk_identical_and_attention_equal_single_rank(world2):
    _check(world2)
    # Interleaved pages: blocks 0, 2, 4.. on rank 0 and 1, 3, 5.. on rank 1 (1+2+4+9+13 = 29 blocks).
    assert [res[("fp32", False, "dense")]["local_pages"] for res in world2] == [16, 13]


def test_dcp_4_ranks_topk_identical_and_attention_equal_single_rank(world4):
    _check(world4)
    assert [res[("fp32", False, "dense")]["local_pages"] for res in world4] == [10, 7, 6, 6]


def test_dcp_world1_without_distributed_equals_single_rank_ops():
    _check([_dcp_worker()])


def test_local_seq_lens_split_every_length_exactly():
    lens = torch.arange(0, 40)
    for world in (1, 2, 3, 4):
        parts = [DCPLayout(r, world, PAGE).local_seq_lens(lens) for r in range(world)]
        assert torch.equal(sum(parts), lens)
        assert all((p >= 0).all() for p in parts)


def test_merge_topk_candidates_equals_select_blocks_on_random_tied_scores():
    gen = torch.Generator().manual_seed(0)
    T, NB = 64, 12
    scores = torch.randint(0, 4, (T, N, NB), generator=gen).float()  # many ties
    pos = torch.randint(0, NB * PAGE, (T,), generator=gen)
    for topk, local, init in SELECT:
        want = select_blocks(scores, (pos // PAGE)[:, None], topk=topk, local_blocks=local, init_blocks=init)
        # Split the blocks over 3 "ranks" as DCP does and give each rank's local top-k to the merge.
        q_block = (pos // PAGE)[:, None]
        ids = torch.arange(NB)
        forced = ((q_block - ids) < local) | (ids < init)
        eligible = (ids <= q_block) & ~forced
        cand_s, cand_i = [], []
        for r in range(3):
            mine = eligible & (ids % 3 == r)
            s = scores.masked_fill(~mine[:, None], float("-inf"))
            order = torch.argsort(s, dim=-1, descending=True, stable=True)[..., :topk]
            keep = mine[:, None].expand_as(s).gather(-1, order)
            cand_s.append(s.gather(-1, order))
            cand_i.append(torch.where(keep, order, -1))
        got = merge_topk_candidates(torch.cat(cand_s, -1), torch.cat(cand_i, -1), pos, PAGE,
                                    topk=topk, local_blocks=local, init_blocks=init)  # fmt: skip
        assert torch.equal(got, want), (topk, local, init)


def test_local_topk_of_a_rank_without_blocks_is_all_padding():
    index, _, table, seq_idx, pos, _, index_q, _ = _case("fp32", False)
    layout = DCPLayout(3, 4, PAGE)
    short = torch.tensor([1, 2, 3, 4, 4])  # every sequence fits in block 0: rank 3 holds nothing
    pages, local_table = shard_pages(index.pages, table, short, layout)
    local_index = PagedIndex(pages, "fp32", index.scale, C)
    scores, ids = dcp_index_local_topk(
        index_q, local_index, local_table, seq_idx, pos.clamp(max=0), short, layout,
        topk=3, local_blocks=1, init_blocks=0,
    )  # fmt: skip
    assert (ids == -1).all() and torch.isneginf(scores).all()


def test_merge_attention_partials_ignores_ranks_without_keys_and_zeroes_empty_queries():
    out = torch.randn(2, 3, H, C)
    lse = torch.randn(2, 3, H)
    lse[1, 0] = float("-inf")  # rank 1 holds no key for token 0: rank 0's output alone
    lse[:, 2] = float("-inf")  # token 2 has no key anywhere: 0, as the single-rank op
    merged = merge_attention_partials(out, lse)
    torch.testing.assert_close(merged[0], out[0, 0])
    assert (merged[2] == 0).all() and torch.isfinite(merged).all()
    w = torch.softmax(lse[:, 1], dim=0)
    torch.testing.assert_close(merged[1], (w[..., None] * out[:, 1]).sum(0))
