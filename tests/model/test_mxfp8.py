"""MXFP8 (OCP MX, E4M3 values + E8M0 scales per 32): scale rule, round trips, vLLM agreement, errors."""

import pytest
import torch

from model.mxfp8 import E8M0_BIAS, dequantize_mxfp8, e8m0_to_float, quantize_mxfp8


def _block(values: list[float]) -> torch.Tensor:
    """One 32-value block: the given values followed by zeros."""
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x


def test_scale_byte_follows_ocp_floor_rule_for_known_amax():
    # amax 1.0: floor(log2 1) - 8 = -8 -> byte 119, and 1.0 scales to 256 (exact in E4M3).
    values, scales = quantize_mxfp8(_block([1.0, -0.5, 0.25]))
    assert scales.tolist() == [[E8M0_BIAS - 8]]
    assert values.float()[0, :3].tolist() == [256.0, -128.0, 64.0]
    assert dequantize_mxfp8(values, scales)[0, :3].tolist() == [1.0, -0.5, 0.25]
    # amax 3.0: floor(log2 3) = 1 -> shared exponent -7 -> byte 120.
    _, scales = quantize_mxfp8(_block([3.0]))
    assert scales.tolist() == [[E8M0_BIAS - 7]]


def test_amax_just_below_power_of_two_gets_lower_exponent():
    # 256 - ulp: fp32 log2 rounds it to exactly 8.0, yet floor(log2) is 7 -> shared -1 -> byte 126.
    below = torch.nextafter(torch.tensor(256.0), torch.tensor(0.0))
    assert torch.log2(below).item() == 8.0  # the trap a log2-based rule falls into
    values, scales = quantize_mxfp8(_block([below.item()]))
    assert scales.tolist() == [[E8M0_BIAS + 7 - 8]]
    assert values.float()[0, 0].item() == 448.0  # 511.99996 saturates


def test_floor_rule_saturates_where_ceil_rule_bumps_the_exponent():
    values, scales = quantize_mxfp8(_block([500.0, 2.0]))
    assert scales.tolist() == [[E8M0_BIAS]]  # floor(log2 500) = 8 -> shared 0
    assert values.float()[0, :2].tolist() == [448.0, 2.0]  # 500 saturates to the E4M3 max
    values, scales = quantize_mxfp8(_block([500.0, 2.0]), scale_rule="ceil")
    assert scales.tolist() == [[E8M0_BIAS + 1]]  # ceil(log2(500 / 448)) = 1
    assert values.float()[0, :2].tolist() == [256.0, 1.0]  # 250 rounds to 256 (spacing 16 there)


def test_all_zero_block_gets_byte_zero_and_dequantizes_to_zero():
    values, scales = quantize_mxfp8(torch.zeros(2, 64))
    assert scales.eq(0).all()
    assert dequantize_mxfp8(values, scales).eq(0).all()


def test_exactly_representable_tensor_round_trips_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    bytes_ = torch.randint(0, 256, (6, 4, 32), generator=g, dtype=torch.uint8)
    bytes_ = torch.where((bytes_ & 0x7F) == 0x7F, bytes_ ^ 0x01, bytes_)  # drop the NaN codes
    # Element 0 of every block gets E4M3 exponent field 15 (|value| in [256, 448], mantissa 0..6;
    # 7 would be NaN), so the floor rule recovers exactly the scale the data was built with.
    first = bytes_[..., 0]
    bytes_[..., 0] = (first & 0x80) | 0x78 | (first % 7)
    values = bytes_.view(torch.float8_e4m3fn).reshape(6, 128)
    scales = torch.randint(100, 150, (6, 4), generator=g, dtype=torch.uint8)
    x = dequantize_mxfp8(values, scales)
    v2, s2 = quantize_mxfp8(x)
    assert torch.equal(s2, scales)
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(dequantize_mxfp8(v2, s2), x)


def test_random_round_trip_error_is_bounded_by_e4m3_precision():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 5
    values, scales = quantize_mxfp8(x)
    x_hat = dequantize_mxfp8(values, scales)
    amax = x.view(16, 8, 32).abs().amax(-1, keepdim=True)
    err = (x_hat - x).view(16, 8, 32).abs()
    # Rounding: half an E4M3 step (2^-4 relative); saturation: at most (512 - 448) / 512 of amax.
    assert (err <= amax * (64 / 512) + 1e-12).all()
    assert (err <= x.view(16, 8, 32).abs() * 2**-4 + amax * 2**-9).float().mean() > 0.95


def test_bf16_input_and_output_dtype():
    x = torch.randn(3, 64).to(torch.bfloat16)
    values, scales = quantize_mxfp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (3, 2)
    assert dequantize_mxfp8(values, scales, torch.bfloat16).dtype == torch.bfloat16


def test_e8m0_byte_255_is_nan_and_others_are_powers_of_two():
    f = e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert torch.isnan(f[255])
    assert torch.equal(f[:255], torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float32))


def test_ceil_rule_matches_vllm_reference_quantizer():
    mx = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 128, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    x[0, :32] = 0.0
    v_ref, s_ref = mx._mxfp8_e4m3_quantize_torch(x)
    values, scales = quantize_mxfp8(x, scale_rule="ceil")
    assert torch.equal(scales, s_ref)
    assert torch.equal(values.view(torch.uint8), v_ref.view(torch.uint8))
    assert torch.equal(
        dequantize_mxfp8(values, scales, torch.bfloat16), mx.dequant_mxfp8_to_bf16(values, scales)
    )


def test_bad_shapes_and_dtypes_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp8(torch.randn(4, 32), scale_rule="round")  # type: ignore[arg-type]
    values, scales = quantize_mxfp8(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_mxfp8(values, scales[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_mxfp8(values.float(), scales)
    with pytest.raises(TypeError, match="uint8"):
        e8m0_to_float(scales.int())
