"""Paged KV cache: byte layouts, append/gather round trips, per-layer dtypes, page copies, errors."""

import dataclasses

import pytest
import torch

from model import nvfp4
from model.config import ModelConfig
from model.kv_cache import KVCache, kv_quant_dequant, slot_mapping

DTYPES = ["fp32", "bf16", "fp8", "nvfp4"]


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), **overrides)


def fill_sequence(cache: KVCache, layer: int, length: int, seed: int = 0):
    """Append `length` random tokens of one sequence in shuffled order; returns (table, k, v, idx)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = -(-length // cache.page_size)
    table_P = torch.randperm(cache.num_pages, generator=g)[:n_pages]
    cfg = cache.config
    k_TNC = torch.randn(length, cfg.num_key_value_heads, cfg.head_dim, generator=g) * 3
    v_TNC = torch.randn(length, cfg.num_key_value_heads, cfg.head_dim, generator=g)
    idx_TC = torch.randn(length, cfg.index_head_dim, generator=g) if cfg.is_sparse_layer(layer) else None
    order = torch.randperm(length, generator=g)
    slots_T = slot_mapping(table_P[None], torch.zeros(length, dtype=torch.long), order, cache.page_size)
    cache.append(layer, slots_T, k_TNC[order], v_TNC[order], None if idx_TC is None else idx_TC[order])
    return table_P, k_TNC, v_TNC, idx_TC


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_gather_round_trip_equals_kv_quant_dequant(dtype):
    cfg = tiny()
    cache = KVCache(cfg, num_pages=12, dtype=dtype, index_dtype=dtype)
    cache.set_scales(1, 0.01, 0.003, 0.02)
    table_P, k_TNC, v_TNC, idx_TC = fill_sequence(cache, layer=1, length=45)
    k_got, v_got = cache.gather(1, table_P, 45)
    assert torch.equal(k_got, kv_quant_dequant(k_TNC, dtype, cache.scales[1, 0]))
    assert torch.equal(v_got, kv_quant_dequant(v_TNC, dtype, cache.scales[1, 1]))
    idx_got = cache.gather_index(1, table_P, 45)
    assert torch.equal(idx_got, kv_quant_dequant(idx_TC[:, None], dtype, cache.scales[1, 2])[:, 0])
    if dtype == "fp32":
        assert torch.equal(k_got, k_TNC)
    else:
        assert not torch.equal(k_got, k_TNC)  # the rounding really happened


def test_nvfp4_simulation_is_model_nvfp4_kv_quant_dequant():
    x = torch.randn(7, 2, 32)
    assert torch.equal(kv_quant_dequant(x, "nvfp4", torch.tensor(0.01)), nvfp4.kv_quant_dequant(x, 0.01))


def test_nvfp4_page_layout_is_vllm_slot_2head_plus_side():
    cfg = tiny(head_dim=128, kv_cache_dtype="nvfp4")
    cache = KVCache(cfg, num_pages=4)
    N, page = cfg.num_key_value_heads, cfg.index_block_size
    assert cache.kv[0].shape == (4, 2 * N, page, 72) and cache.kv[0].dtype == torch.uint8
    k_TNC, v_TNC = torch.randn(3, N, 128), torch.randn(3, N, 128)
    slots_T = torch.tensor([2 * page + 5, 0 * page + 1, 3 * page + 15])
    cache.set_scales(0, 0.004, 0.002)
    cache.append(0, slots_T, k_TNC, v_TNC)
    k_rows = nvfp4.kv_quantize(k_TNC, 0.004)
    v_rows = nvfp4.kv_quantize(v_TNC, 0.002)
    for t, slot in enumerate(slots_T.tolist()):
        page_id, off = divmod(slot, page)
        for h in range(N):
            assert torch.equal(cache.kv[0][page_id, 2 * h, off], k_rows[t, h])
            assert torch.equal(cache.kv[0][page_id, 2 * h + 1, off], v_rows[t, h])


def test_bytes_per_token_match_published_m3_figures():
    flash = KVCache(ModelConfig.preset("m3.1-flash"), num_pages=1)
    m3 = KVCache(ModelConfig.preset("m3"), num_pages=1)
    assert flash.bytes_per_token(10) == 2 * 4 * 72
    assert sum(flash.bytes_per_token(i) for i in range(60)) == 34_560
    assert sum(m3.bytes_per_token(i) for i in range(60)) == 61_440
    assert m3.index_bytes_per_token(3) == 128 * 2 and m3.index_bytes_per_token(0) == 0  # bf16 index keys


def test_nvfp4_row_width_is_c_over_2_plus_c_over_16_for_any_head_dim():
    cache = KVCache(tiny(kv_cache_dtype="nvfp4", index_cache_dtype="nvfp4"), num_pages=2)
    assert cache.kv[0].shape[-1] == 32 // 2 + 32 // 16 == 18
    assert cache.index[1].shape[-1] == 18
    assert cache.bytes_per_token(0) == 2 * 2 * 18


def test_per_layer_overrides_pick_each_layers_dtype():
    cfg = tiny(kv_cache_dtype="nvfp4", kv_cache_dtype_overrides={0: "bf16", 2: "fp8"})
    cache = KVCache(cfg, num_pages=3)
    assert cache.kv_dtypes == ["bf16", "nvfp4", "fp8", "nvfp4"]
    assert cache.kv[0].dtype == torch.bfloat16 and cache.kv[0].shape[-1] == 32
    assert cache.kv[1].dtype == torch.uint8 and cache.kv[1].shape[-1] == 18
    assert cache.kv[2].dtype == torch.uint8 and cache.kv[2].shape[-1] == 32
    assert cache.index[0] is None and cache.index[1] is not None
    table_P, k_TNC, _, _ = fill_sequence(cache, layer=2, length=20)
    assert torch.equal(cache.gather(2, table_P, 20)[0], kv_quant_dequant(k_TNC, "fp8", cache.scales[2, 0]))


def test_explicit_dtype_overrides_config_for_every_layer():
    cfg = tiny(kv_cache_dtype="nvfp4", kv_cache_dtype_overrides={0: "bf16"})
    assert KVCache(cfg, num_pages=1, dtype="fp32").kv_dtypes == ["fp32"] * 4


def test_fp8_saturates_out_of_range_values_instead_of_nan():
    x = torch.tensor([[[1000.0, -1e6, 3.0, 0.0]]])
    out = kv_quant_dequant(x, "fp8", torch.tensor(1.0))
    assert torch.equal(out, torch.tensor([[[448.0, -448.0, 3.0, 0.0]]]))


@pytest.mark.parametrize("dtype", ["bf16", "nvfp4"])
def test_copy_pages_duplicates_every_layer_and_leaves_sources_intact(dtype):
    cache = KVCache(tiny(), num_pages=10, dtype=dtype, index_dtype=dtype)
    src = fill_sequence(cache, layer=0, length=40, seed=3)[0]
    assert torch.equal(fill_sequence(cache, layer=1, length=40, seed=3)[0], src)  # same pages
    dst = torch.tensor([p for p in range(10) if p not in src.tolist()][: len(src)])
    before = [cache.gather(layer, src, 40) for layer in (0, 1)]
    cache.copy_pages(src, dst)
    for layer in (0, 1):
        for got, want in zip(cache.gather(layer, dst, 40), before[layer]):
            assert torch.equal(got, want)
        for got, want in zip(cache.gather(layer, src, 40), before[layer]):
            assert torch.equal(got, want)
    assert torch.equal(cache.gather_index(1, dst, 40), cache.gather_index(1, src, 40))


def test_truncation_is_a_shorter_length_and_stale_slots_are_overwritten():
    cache = KVCache(tiny(), num_pages=4, dtype="fp32", index_dtype="fp32")
    table_P, k_TNC, _, _ = fill_sequence(cache, layer=1, length=30)
    k_short, _ = cache.gather(1, table_P, 20)  # rollback to 20 tokens
    assert torch.equal(k_short, k_TNC[:20])
    new_k = torch.randn(1, 2, 32)
    slot = slot_mapping(table_P[None], torch.tensor([0]), torch.tensor([20]), cache.page_size)
    cache.append(1, slot, new_k, new_k, torch.randn(1, 32))
    assert torch.equal(cache.gather(1, table_P, 21)[0][20], new_k[0])


def test_bad_inputs_raise_clear_errors():
    cache = KVCache(tiny(), num_pages=4)
    slots = torch.tensor([0, 1])
    k = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match=r"k_TNC has shape \(2, 2, 16\), expected \(T=2, N=2, C=32\)"):
        cache.append(0, slots, k[..., :16], k)
    with pytest.raises(ValueError, match="slot_mapping_T must be a 1-D integer tensor"):
        cache.append(0, slots.float(), k, k)
    with pytest.raises(ValueError, match="layer 1 is sparse: append needs index_k_TC"):
        cache.append(1, slots, k, k)
    with pytest.raises(ValueError, match="full-attention layer"):
        cache.append(0, slots, k, k, torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"index_k_TC has shape \(2, 16\)"):
        cache.append(1, slots, k, k, torch.randn(2, 16))
    with pytest.raises(ValueError, match="length 40 needs 3 pages but the block table holds 2"):
        cache.gather(0, torch.tensor([0, 1]), 40)
    with pytest.raises(ValueError, match="no index cache"):
        cache.gather_index(0, torch.tensor([0]), 3)
    with pytest.raises(ValueError, match="dtype='fp4' is not a KV cache dtype"):
        KVCache(tiny(), num_pages=4, dtype="fp4")
    with pytest.raises(ValueError, match="src and dst must be 1-D and of equal length"):
        cache.copy_pages([0, 1], [2])
