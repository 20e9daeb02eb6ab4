"""Triton decode autotuning and the indexer: what the equivalence checks (tests/model/test_kernel_groups.py,
group "indexer") do not cover: configurations that fail to compile, tuning keys."""

import pytest
import torch

pytest.importorskip("triton")


def _failing_compile():
    raise RuntimeError("PassManager::run failed")


def test_safe_do_bench_times_a_config_that_fails_to_compile_as_inf_and_warns_once():
    from model.kernels import triton_common as tc

    def bench(fn, quantiles):
        fn()
        return [1.0] * len(quantiles)

    with pytest.warns(UserWarning, match="failed to compile"):
        assert tc.safe_do_bench(_failing_compile, (0.5, 0.2, 0.8), bench=bench) == [float("inf")] * 3
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same failure again: no second warning
        assert tc.safe_do_bench(_failing_compile, None, bench=bench) == float("inf")
    assert tc.safe_do_bench(lambda: None, (0.5,), bench=bench) == [1.0]


def test_safe_do_bench_reraises_errors_that_are_not_compile_failures():
    from model.kernels import triton_common as tc

    def bench(fn, quantiles):
        return fn()

    def launch_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        tc.safe_do_bench(launch_error, (0.5,), bench=bench)
    with pytest.raises(ValueError):
        tc.safe_do_bench(lambda: (_ for _ in ()).throw(ValueError("bad arg")), (0.5,), bench=bench)


def test_every_decode_autotuner_skips_configs_that_fail_to_compile():
    from model.kernels import triton_gemv, triton_indexer, triton_moe, triton_sparse_attention
    from model.kernels.triton_common import safe_do_bench

    tuners = [triton_indexer._index_scores_tuned, triton_sparse_attention._sparse_attn_tuned,
              triton_gemv._w4a16_gemv_tuned, triton_moe._nvfp4_moe_tuned]  # fmt: skip
    assert all(t._do_bench is safe_do_bench for t in tuners)


def test_decode_autotuners_key_on_size_classes_not_exact_batch_sizes():
    """An engine's batch changes at every step: the varying sizes enter the keys only as classes."""
    from model.kernels import triton_moe, triton_sparse_attention
    from model.kernels.triton_common import tune_class

    varying = {"n_slots", "n_rows", "n_mblocks", "n_work", "BPS", "SPLITS"}
    attn = triton_sparse_attention
    tuners = [attn._sparse_attn_tuned, triton_moe._nvfp4_moe_tuned]
    for t in tuners:
        assert "tune_class" in t.keys and not varying & set(t.keys), t.keys
    assert tune_class(64) == tune_class(127) != tune_class(128)
    assert tune_class(3, 64) != tune_class(64, 3) and tune_class(0) == 0


@pytest.mark.parametrize("variant", ["v3", "v4", "v5", "v6"])
def test_indexer_deleted_variant_raises_naming_the_valid_ones(variant):
    """v3-v6 were deleted (each measured slower than its successor, v6 than the CUDA v7): naming one is
    an error that lists the valid ones."""
    from model.kernels.triton_indexer import index_block_scores_triton

    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    pages = torch.zeros(2, 16, 72, dtype=torch.uint8)
    table, seq = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    pos = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'v7', 'v2'"):
        index_block_scores_triton(q, pages, "nvfp4", torch.tensor(1.0), table, seq, pos, variant=variant)
