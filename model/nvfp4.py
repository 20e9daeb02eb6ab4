"""NVFP4: the project's one quantization function (E2M1 values, E4M3 block scales, fp32 global).

What: `quantize` / `dequantize` (packed E2M1 codes, one float8_e4m3fn scale per 16 values along K,
one fp32 dequant-side `scale_2`), `quant_dequant` (W4A4 activation fake-quant), `kv_*` (one KV row of
C values as C/2 code bytes then C/16 scale bytes: 72 B at C = 128), `to_modelopt` / `from_modelopt`.
Why one module: the learner must see exactly the weights and KV values the engines serve, so every
path goes through `_encode`. The definition, bit for bit (vLLM's `ref_nvfp4_quant`), is
docs/FACTS.md, "NVFP4 format"; the operation order is spelled out above `_rcp` below.

Invariants: deterministic, CPU and CUDA byte for byte (only correctly rounded fp32 elementwise ops,
maxima and an fp64 error sum for 4-over-6); an all-zero tensor dequantizes to exact zeros; NaN/inf
input raises when `check_finite` (one host sync: hot loops pass False); K % 16 != 0 raises.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
"""Values per E4M3 block scale, along the last dimension."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX
"""2688: the default scale_2 is amax / 2688 so the largest block scale lands on 448."""
AMAX_FLOOR = 1e-8
"""Lower bound on amax for the default global scale (vLLM's choice); keeps 1/scale_2 finite."""

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""fp32 value of each 4-bit code (index = code: bit 3 sign, bits 0-2 magnitude index)."""

# Both nibbles of every byte decoded at once: row b = (value of low nibble, value of high nibble).
_BYTE_VALUES = torch.stack([E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)], dim=-1)

# Rows per chunk are chosen so a chunk holds about this many values. It bounds the fp32
# temporaries when quantizing 100M-parameter expert banks; on CPU small chunks stay in cache and
# avoid page-faulting fresh buffers, on CUDA large ones keep the ~25 kernel launches per chunk cheap.
_CHUNK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 24}

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor of logical shape [..., K]; layout in the notes above `_rcp`."""

    packed: torch.Tensor  # uint8 [..., K/2]
    scales: torch.Tensor  # float8_e4m3fn [..., K/16]
    scale_2: torch.Tensor  # fp32, 0-dim or broadcastable to [..., 1]

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8:
            raise TypeError(f"NVFP4Tensor.packed must be uint8, got {self.packed.dtype}")
        if self.scales.dtype != torch.float8_e4m3fn:
            raise TypeError(f"NVFP4Tensor.scales must be float8_e4m3fn, got {self.scales.dtype}")
        if self.scale_2.dtype != torch.float32:
            raise TypeError(f"NVFP4Tensor.scale_2 must be float32, got {self.scale_2.dtype}")
        lead, h = tuple(self.packed.shape[:-1]), self.packed.shape[-1]
        if h % (BLOCK_SIZE // 2) or tuple(self.scales.shape) != (*lead, h // (BLOCK_SIZE // 2)):
            raise ValueError(
                f"NVFP4Tensor: packed {tuple(self.packed.shape)} and scales {tuple(self.scales.shape)} "
                f"disagree; expected scales [..., K/16] for packed [..., K/2] with K a multiple of 16"
            )

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape [..., K]."""
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.scale_2.nbytes

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(self.packed.to(device), self.scales.to(device), self.scale_2.to(device))


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15, K even) -> uint8 [..., K/2], low nibble = even element."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_e2m1 needs uint8 codes with an even last dim, got {codes.dtype} {codes.shape}"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., H] -> uint8 codes [..., 2H] (inverse of pack_e2m1)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1 needs uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Core (shared by every path)
# ---------------------------------------------------------------------------------------------


# Shape legend: R rows (leading dims flattened), K values per row, B = K/16 blocks, G = 16 values per
# block, H = K/2 packed bytes, T tokens, N kv heads, C head dim.
#
# Numerics, all fp32 and in this order, for x viewed as blocks x_RBG:
#   gs      = 1 / scale_2            (quant-side global, as vLLM derives it from a checkpoint scale)
#   amax_RB = max |x_RBG|            (exact in the input dtype)
#   s_RB    = e4m3(clamp(gs * (amax_RB * (1/6)), -448, 448))      round-to-nearest-even cast
#   m_RB    = rcp(float(s_RB) * rcp(gs)),  rcp(v) = 1 / (v + (v == 0) * 1e8)   (s = 0 -> m = 1e-8)
#   v       = clamp(float(x) * m_RB, -6, 6)
#   code    = sign (0x8 iff v < 0, so -0.0 gives +0) | E2M1 magnitude index, round to nearest with
#             ties to the even mantissa (thresholds in docs/FACTS.md, "NVFP4 format")
#   dequant = e2m1(code) * (float(s_RB) * scale_2), then one cast to the output dtype
# Default global: scale_2 = max(amax(|x|), 1e-8) / 2688 (2688 = 6 * 448; the 1e-8 floor is vLLM's
# online quantizer's and keeps gs finite, so zeros get block scales 0 and codes 0). Divisions are
# tensor / tensor: CUDA turns a division by a Python scalar into a multiply by its reciprocal.
# Layouts: `packed` uint8 [..., K/2], LOW nibble = even element; `scales` float8_e4m3fn [..., K/16]
# (linear, unswizzled); `scale_2` fp32, 0-dim or broadcastable to x.shape[:-1] + (1,) (e.g.
# [E, 1, 1] for a stacked expert bank, one global per expert).
def _rcp(v: torch.Tensor) -> torch.Tensor:
    # vLLM's guarded reciprocal, kept in its exact form (a plain where() would give the same bits,
    # this form also stays CUDA-graph friendly): 1/v, or 1/1e8 where v == 0.
    return 1.0 / (v + (v == 0) * 1e8)


@functools.cache
def _const(name: str, device: torch.device) -> torch.Tensor:
    """A module constant, copied to `device` once (no host-to-device copy per call; graph-safe)."""
    key = (name, str(device))
    t = _DEVICE_CONSTS.get(key)
    if t is None:
        with torch.inference_mode(False):  # a normal tensor: autograd may save it for backward later
            t = _DEVICE_CONSTS[key] = _CONSTS[name].to(device)
    return t


def _lookup(table: str, idx: torch.Tensor) -> torch.Tensor:
    """Rows of a small fp32 constant table [V, W] -> [..., W]; embedding is the fastest gather."""
    return torch.nn.functional.embedding(idx.int(), _const(table, idx.device))


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 scaled values (already clamped to [-6, 6], or not: both give the same codes; v may be
    overwritten) -> uint8 codes, ties as docs/FACTS.md, "NVFP4 format" says. One dispatch point, two
    implementations proven equal by the tests: CUDA runs one binary-search pass (6x faster there
    than the comparison chain), the CPU runs the comparison chain (4x faster there than bucketize).
    """
    return _e2m1_codes_search(v) if v.is_cuda else _e2m1_codes_compare(v)


def _e2m1_codes_compare(v: torch.Tensor) -> torch.Tensor:
    v = v.clamp_(-E2M1_MAX, E2M1_MAX)
    sign = (v < 0).view(torch.uint8) << 3  # -0.0 is not < 0: it gets code 0, as in vLLM
    a = v.abs_()
    # Alternating strict / non-strict comparisons implement ties-to-even-mantissa: a tie at an odd
    # boundary (0.25, 1.25, 2.5, 5) rounds down, at an even one (0.75, 1.75, 3.5) rounds up.
    idx = (a > 0.25).view(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    return idx.bitwise_or_(sign)


def _below(t: float) -> float:
    """Largest fp32 below t: `v > _below(t)` is `v >= t` for fp32 v."""
    return torch.nextafter(torch.tensor(t), torch.tensor(-float("inf"))).item()


# bucketize(v, B) counts the boundaries strictly below v, so a boundary t gives "v > t" and
# _below(t) gives "v >= t". Ascending; position p in 0..15 covers, left to right, the codes
# 15 (v < -5), 14 ([-5, -3.5]), 13, 12, 11, 10, 9, 8 ([-0.25, 0)), 0 ([0, 0.25], -0.0 included),
# 1, ..., 7 (v > 5): the same intervals as the comparison chain plus the sign rule.
_SIGNED_BOUNDARIES = torch.tensor(
    [
        *(_below(-5.0), -3.5, _below(-2.5), -1.75, _below(-1.25), -0.75, _below(-0.25), _below(0.0)),
        *(0.25, _below(0.75), 1.25, _below(1.75), 2.5, _below(3.5), 5.0),
    ],
    dtype=torch.float32,
)


_DEVICE_CONSTS: dict[tuple[str, str], torch.Tensor] = {}  # (name, device) -> its copy there
_CONSTS = {
    "code_values": E2M1_VALUES.unsqueeze(-1),
    "byte_values": _BYTE_VALUES,
    "boundaries": _SIGNED_BOUNDARIES,
    "divisor": torch.tensor(GLOBAL_DIVISOR),
}


def _e2m1_codes_search(v: torch.Tensor) -> torch.Tensor:
    p = torch.bucketize(v, _const("boundaries", v.device), out_int32=True).to(torch.uint8)
    # p -> code: p >= 8 gives p - 8 = p ^ 8, p < 8 gives 15 - p = p ^ 15.
    return p ^ (15 ^ ((p >> 3) * 7))


def _block_scales(amax_RB: torch.Tensor, gs_R1: torch.Tensor, divisor: float) -> torch.Tensor:
    # Python-float reciprocal multiplies in fp32, exactly like vLLM's `vec_max * (1 / 6)`.
    return (gs_R1 * (amax_RB * (1 / divisor))).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _codes_for_scales(x_RBG: torch.Tensor, s_RB: torch.Tensor, gs_R1: torch.Tensor) -> torch.Tensor:
    m_RB = _rcp(s_RB.float() * _rcp(gs_R1))
    v_RBG = x_RBG * m_RB.unsqueeze(-1)  # bf16/fp16 promote exactly to fp32 inside the multiply
    return _e2m1_codes(v_RBG)


def _decode(codes_RBG: torch.Tensor, s_RB: torch.Tensor, scale_2_R1: torch.Tensor) -> torch.Tensor:
    """fp32 values e2m1(code) * (float(s) * scale_2), the weight/KV dequant order."""
    vals_RBG = _lookup("code_values", codes_RBG).squeeze(-1)
    return vals_RBG * (s_RB.float() * scale_2_R1).unsqueeze(-1)


def _encode_rows(
    x_RK: torch.Tensor, scale_2_R1: torch.Tensor, four_over_six: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize 2-D rows chunk by chunk -> (codes uint8 [R, K], scales e4m3 [R, B], finite flag)."""
    R, K = x_RK.shape
    B = K // BLOCK_SIZE
    gs_R1 = 1.0 / scale_2_R1
    step = max(1, _CHUNK_VALUES.get(x_RK.device.type, 1 << 24) // K)
    if step >= R:  # one chunk: no copy into the outputs
        return _encode_chunk(x_RK.view(R, B, BLOCK_SIZE), gs_R1, scale_2_R1, four_over_six)
    codes_RK = torch.empty((R, K), dtype=torch.uint8, device=x_RK.device)
    s_out_RB = torch.empty((R, B), dtype=torch.float8_e4m3fn, device=x_RK.device)
    is_finite = torch.ones((), dtype=torch.bool, device=x_RK.device)
    for r0 in range(0, R, step):  # loop over chunks of rows, not over blocks
        r1 = min(R, r0 + step)
        x_RBG = x_RK[r0:r1].view(r1 - r0, B, BLOCK_SIZE)
        gs_c = gs_R1[r0:r1] if gs_R1.shape[0] > 1 else gs_R1
        sc2_c = scale_2_R1[r0:r1] if scale_2_R1.shape[0] > 1 else scale_2_R1
        codes, s_RB, chunk_finite = _encode_chunk(x_RBG, gs_c, sc2_c, four_over_six)
        codes_RK[r0:r1] = codes
        s_out_RB[r0:r1] = s_RB
        is_finite &= chunk_finite
    return codes_RK, s_out_RB, is_finite


def _block_amax(x_RBG: torch.Tensor) -> torch.Tensor:
    """max |x| over each block of 16, as fp32 (exact in the input dtype; NaN propagates; -0 -> +0).

    A halving tree of elementwise maxima: 2.5x faster on CUDA than amax(dim=-1), whose reduction
    kernel handles a 16-wide innermost dimension poorly; the same speed on the CPU.
    """
    a = x_RBG.abs()
    for half in (8, 4, 2, 1):
        a = torch.maximum(a[..., :half], a[..., half:])
    return a.squeeze(-1).float()


def _encode_chunk(
    x_RBG: torch.Tensor, gs_R1: torch.Tensor, scale_2_R1: torch.Tensor, four_over_six: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R, B, G = x_RBG.shape
    amax_RB = _block_amax(x_RBG)
    s_RB = _block_scales(amax_RB, gs_R1, E2M1_MAX)
    codes_RBG = _codes_for_scales(x_RBG, s_RB, gs_R1)
    if four_over_six:
        s_RB, codes_RBG = _pick_four_over_six(x_RBG, amax_RB, gs_R1, scale_2_R1, s_RB, codes_RBG)
    return codes_RBG.view(R, B * G), s_RB, torch.isfinite(amax_RB).all()


def _pick_four_over_six(
    x_RBG: torch.Tensor,
    amax_RB: torch.Tensor,
    gs_R1: torch.Tensor,
    scale_2_R1: torch.Tensor,
    s6_RB: torch.Tensor,
    codes6_RBG: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block keep the max/6 scale unless the max/4 scale has strictly smaller squared error.

    Error = sum over the block of (dequant - x)^2 with dequant = e2m1 * (float(s) * scale_2) in
    fp32 exactly as `dequantize` produces it, differences and sum in fp64 (so the choice does not
    hinge on fp32 summation order). Same global scale for both candidates; ties keep max/6.
    """
    s4_RB = _block_scales(amax_RB, gs_R1, 4.0)
    codes4_RBG = _codes_for_scales(x_RBG, s4_RB, gs_R1)
    x64_RBG = x_RBG.double()
    err6_RB = (_decode(codes6_RBG, s6_RB, scale_2_R1).double() - x64_RBG).square_().sum(-1)
    err4_RB = (_decode(codes4_RBG, s4_RB, scale_2_R1).double() - x64_RBG).square_().sum(-1)
    use4_RB = err4_RB < err6_RB
    s_RB = torch.where(use4_RB, s4_RB.view(torch.uint8), s6_RB.view(torch.uint8)).view(torch.float8_e4m3fn)
    return s_RB, torch.where(use4_RB.unsqueeze(-1), codes4_RBG, codes6_RBG)


def _check_input(x: torch.Tensor, who: str) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{who}: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE or x.shape[-1] == 0:
        raise ValueError(
            f"{who}: last dim must be a positive multiple of {BLOCK_SIZE} (one E4M3 scale per 16 values), "
            f"got shape {tuple(x.shape)}; pad K or keep this tensor unquantized"
        )


def _raise_non_finite(x: torch.Tensor, who: str) -> None:
    n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    raise ValueError(
        f"{who}: input contains {n_nan} NaN and {n_inf} inf values; NVFP4 cannot encode them "
        f"(fix the producer or clamp before quantizing)"
    )


@functools.lru_cache(maxsize=1024)
def _float_scale_on(value: float, device: torch.device) -> torch.Tensor | None:
    """A float global scale as an fp32 tensor on device, or None if it is unusable. Cached: a
    per-layer k_scale passed as a float then costs no host-to-device copy (a stream sync) per call."""
    g = torch.tensor(value, dtype=torch.float32)
    if not (g > 0 and torch.isfinite(g) and torch.isfinite(1.0 / g)):
        return None
    return g.to(device)


def _as_scale_2(global_scale: float | torch.Tensor, x: torch.Tensor, who: str) -> torch.Tensor:
    """Dequant-side global scale as fp32 on x.device, broadcastable to x.shape[:-1] + (1,)."""
    if isinstance(global_scale, (int, float)):
        g = _float_scale_on(float(global_scale), x.device)
        if g is None:
            raise ValueError(
                f"{who}: global scale must be positive with a finite fp32 reciprocal, got {global_scale}"
            )
        return g.clone()  # callers may keep (and modify) the returned scale; the cache stays intact
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"{who}: global scale must be a float or a tensor, got {type(global_scale)}")
    g = global_scale.to(device=x.device, dtype=torch.float32)
    try:
        torch.broadcast_shapes(g.shape, (*x.shape[:-1], 1))
    except RuntimeError:
        raise ValueError(
            f"{who}: global scale of shape {tuple(g.shape)} does not broadcast to "
            f"{(*x.shape[:-1], 1)} (one scale per tensor, or per leading index with a trailing 1)"
        ) from None
    return g


def _scale_2_rows(scale_2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[R, 1] per-row global (or [1, 1] when it is one scalar for all rows)."""
    if scale_2.numel() == 1:
        return scale_2.reshape(1, 1)
    return scale_2.expand(*x.shape[:-1], 1).reshape(-1, 1)


def compute_scale_2(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Default dequant-side global max(amax|x|, 1e-8) / 2688, over all of x or over `dim` (keepdim).

    Example: for a stacked bank w_ENK, `compute_scale_2(w_ENK, dim=(-2, -1))` gives one global per
    expert, shape [E, 1, 1], as ModelOpt stores per-expert `weight_scale_2`.
    """
    if x.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    elif dim is None:
        lo, hi = torch.aminmax(x)
        amax = torch.maximum(hi, -lo).float()
    else:
        amax = x.abs().amax(dim=dim, keepdim=True).float()
    # Tensor / tensor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # which is not correctly rounded and would make scale_2 differ from the CPU's by one ulp.
    return amax.clamp_min(AMAX_FLOOR) / _const("divisor", amax.device)


def _encode(x: torch.Tensor, global_scale, four_over_six: bool, check_finite: bool, who: str):
    """-> (codes uint8 [..., K], scales e4m3 [..., B], scale_2 fp32) for any leading dims."""
    _check_input(x, who)
    if global_scale is None:
        scale_2 = compute_scale_2(x)
        is_ok = torch.isfinite(scale_2)
    else:
        scale_2 = _as_scale_2(global_scale, x, who)
        is_ok = torch.ones((), dtype=torch.bool, device=x.device)
        if check_finite:
            # gs = 1/scale_2 must be finite and positive for the block-scale formula to hold.
            is_ok = is_ok & ((scale_2 > 0) & torch.isfinite(1.0 / scale_2) & torch.isfinite(scale_2)).all()
    x_RK = x.reshape(-1, x.shape[-1])
    if not x_RK.is_contiguous():
        x_RK = x_RK.contiguous()
    codes_RK, s_RB, is_finite = _encode_rows(x_RK, _scale_2_rows(scale_2, x), four_over_six)
    # SYNC: one host read per call, only when asked, to reject NaN/inf inputs and bad scales.
    if check_finite and not bool(is_ok & is_finite):
        if not bool(torch.isfinite(x).all()):
            _raise_non_finite(x, who)
        raise ValueError(f"{who}: global scale must be positive with a finite reciprocal, got {scale_2}")
    lead = x.shape[:-1]
    return codes_RK.view(*lead, -1), s_RB.view(*lead, -1), scale_2


# ---------------------------------------------------------------------------------------------
# Public: tensors and checkpoints
# ---------------------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    global_scale: float | torch.Tensor | None = None,
    *,
    four_over_six: bool = False,
    check_finite: bool = True,
) -> NVFP4Tensor:
    """Quantize x [..., K] (fp32/bf16/fp16, any device, K % 16 == 0) to NVFP4.

    global_scale is the dequant-side scale_2 (amax / 2688 convention); default compute_scale_2(x).
    four_over_six: per block choose max/6 or max/4 scaling by least squared error (nvfp4_4over6).
    """
    codes, scales, scale_2 = _encode(x, global_scale, four_over_six, check_finite, "nvfp4.quantize")
    return NVFP4Tensor(pack_e2m1(codes), scales, scale_2)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Tensor -> [..., K] in dtype: e2m1 * (float(scale) * scale_2) in fp32, cast once."""
    lead, H = t.packed.shape[:-1], t.packed.shape[-1]
    B = H // (BLOCK_SIZE // 2)
    vals_RBG = _lookup("byte_values", t.packed.reshape(-1, H)).view(-1, B, BLOCK_SIZE)
    s_RB = t.scales.reshape(-1, B).float()
    out = vals_RBG * (s_RB * _scale_2_rows(t.scale_2, t.packed)).unsqueeze(-1)
    return out.to(dtype).view(*lead, 2 * H)


class _StraightThrough(torch.autograd.Function):
    """Forward returns the fake-quantized tensor bit for bit; backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
        return x_hat

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _with_ste(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    return _StraightThrough.apply(x, x_hat) if x.requires_grad else x_hat


def quant_dequant(
    x: torch.Tensor, input_scale: float | torch.Tensor, *, check_finite: bool = True
) -> torch.Tensor:
    """W4A4 activation fake-quant with a calibrated input_scale (= activation amax / 2688).

    Bit-exact with vLLM's `ref_nvfp4_quant_dequant(x, 1 / input_scale)`: quantize as above, then
    e2m1 * (float(s) / gs) with gs = 1/input_scale (a division, not the weight path's multiply by
    scale_2; the two can differ by one fp32 ulp). Returns x.dtype; gradient is straight-through.
    """
    xd = x.detach()
    codes, s, scale_2 = _encode(xd, input_scale, False, check_finite, "nvfp4.quant_dequant")
    K = x.shape[-1]
    gs_R1 = 1.0 / _scale_2_rows(scale_2, xd)
    vals_RBG = _lookup("code_values", codes.reshape(-1, K // BLOCK_SIZE, BLOCK_SIZE)).squeeze(-1)
    out = vals_RBG * (s.reshape(-1, K // BLOCK_SIZE).float() / gs_R1).unsqueeze(-1)
    return _with_ste(x, out.view(x.shape).to(x.dtype))


def to_modelopt(
    prefix: str, t: NVFP4Tensor, input_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """ModelOpt checkpoint tensors: {prefix}weight uint8 [N, K/2], {prefix}weight_scale e4m3
    [N, K/16], {prefix}weight_scale_2 fp32 (0-dim), and {prefix}input_scale fp32 if given."""
    out = {
        f"{prefix}weight": t.packed,
        f"{prefix}weight_scale": t.scales,
        f"{prefix}weight_scale_2": t.scale_2.reshape(()) if t.scale_2.numel() == 1 else t.scale_2,
    }
    if input_scale is not None:
        out[f"{prefix}input_scale"] = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    return out


def from_modelopt(tensors: dict[str, torch.Tensor], prefix: str) -> NVFP4Tensor:
    """Inverse of to_modelopt; checks names and dtypes and says which key is wrong."""
    expected = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32}
    got = {}
    for name, dtype in expected.items():
        key = f"{prefix}{name}"
        if key not in tensors:
            raise KeyError(
                f"from_modelopt: missing {key!r} (NVFP4 needs {sorted(expected)} under {prefix!r})"
            )
        if tensors[key].dtype != dtype:
            raise ValueError(f"from_modelopt: {key!r} has dtype {tensors[key].dtype}, expected {dtype}")
        got[name] = tensors[key]
    scale_2 = got["weight_scale_2"]
    if scale_2.numel() == 1:
        scale_2 = scale_2.reshape(())
    return NVFP4Tensor(got["weight"], got["weight_scale"], scale_2)


# ---------------------------------------------------------------------------------------------
# Public: KV cache rows
# ---------------------------------------------------------------------------------------------


def kv_bytes_per_head(head_dim: int) -> int:
    """Bytes per token per head per side: C/2 codes + C/16 scales (72 for C = 128)."""
    if head_dim % BLOCK_SIZE:
        raise ValueError(f"NVFP4 KV needs head_dim % 16 == 0, got {head_dim}")
    return head_dim // 2 + head_dim // BLOCK_SIZE


def _split_kv(buf: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    if buf.dtype != torch.uint8 or buf.shape[-1] % 9:
        raise ValueError(f"{who}: expected uint8 [..., C/2 + C/16] rows, got {buf.dtype} {tuple(buf.shape)}")
    H = buf.shape[-1] * 8 // 9  # C/2 code bytes of the C*9/16 bytes per row
    return buf[..., :H], buf[..., H:].view(torch.float8_e4m3fn)


def kv_quantize(
    x: torch.Tensor,
    global_scale: float | torch.Tensor,
    *,
    four_over_six: bool = False,
    check_finite: bool = True,
) -> torch.Tensor:
    """x [..., C] (e.g. [T, N, C]) -> uint8 [..., C/2 + C/16]: C/2 packed code bytes, then the C/16
    e4m3 scale bytes. Same numerics as quantize(x, global_scale) row by row; global_scale is the
    fp32 dequant-side per-layer-per-side scale (k_scale / v_scale).

    Each row keeps its 72 bytes together (docs/FACTS.md, "NVFP4 KV cache"). vLLM's FlashInfer
    backend instead stores a page side as all code bytes, then all scale bytes
    (`nvfp4_split_data_scale`); the bytes of a row are the same, only their place in the page
    differs, which is the paged cache's concern."""
    codes, scales, _ = _encode(x, global_scale, four_over_six, check_finite, "nvfp4.kv_quantize")
    return torch.cat([pack_e2m1(codes), scales.view(torch.uint8)], dim=-1)


def kv_dequantize(
    buf: torch.Tensor, global_scale: float | torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """uint8 rows [..., C/2 + C/16] -> [..., C] in dtype (same numerics as dequantize)."""
    packed, scales = _split_kv(buf, "nvfp4.kv_dequantize")
    scale_2 = _as_scale_2(global_scale, buf, "nvfp4.kv_dequantize")
    return dequantize(NVFP4Tensor(packed, scales, scale_2), dtype)


def kv_dequantize_fp8(
    buf: torch.Tensor, global_scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows [..., C/2 + C/16] -> (fp8 values [..., C], fp32 0-dim global factor).

    What a Blackwell QMUL4-style path hands the FP8 tensor cores: each value is
    e4m3_rne(clamp(e2m1(code) * float(s_block), -448, 448)) (the product is exact in fp32; the cast
    rounds to nearest-even and saturates) and the real value is fp8 * factor, factor = global_scale.
    Lossless only where |e2m1 * s| <= 448 and fits E4M3's 3 mantissa bits; e.g. 1.5 * 1.875 =
    2.8125 rounds to 2.75, products below 2^-10 flush to 0, and a cache calibrated with the weight
    rule global = amax/2688 has block scales up to 448, so its largest values (6 * s > 448)
    saturate. Calibrate the KV global as amax/448 (block scales <= 74.7) to avoid saturation.
    """
    packed, scales = _split_kv(buf, "nvfp4.kv_dequantize_fp8")
    H = packed.shape[-1]
    B = H // (BLOCK_SIZE // 2)
    vals_RBG = _lookup("byte_values", packed.reshape(-1, H)).view(-1, B, BLOCK_SIZE)
    prod_RBG = vals_RBG * scales.reshape(-1, B).float().unsqueeze(-1)
    fp8 = prod_RBG.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    factor = _as_scale_2(global_scale, buf, "nvfp4.kv_dequantize_fp8")
    return fp8.view(*packed.shape[:-1], 2 * H), factor


def kv_quant_dequant(
    x: torch.Tensor,
    global_scale: float | torch.Tensor,
    *,
    four_over_six: bool = False,
    check_finite: bool = True,
) -> torch.Tensor:
    """What the NVFP4 KV cache gives back for x [..., C]: equals
    kv_dequantize(kv_quantize(x, g), g, x.dtype) bit for bit, without packing. Training uses it
    to make attention see the cached values; gradient is straight-through."""
    xd = x.detach()
    codes, s, scale_2 = _encode(xd, global_scale, four_over_six, check_finite, "nvfp4.kv_quant_dequant")
    B = x.shape[-1] // BLOCK_SIZE
    out = _decode(codes.reshape(-1, B, BLOCK_SIZE), s.reshape(-1, B), _scale_2_rows(scale_2, xd))
    return _with_ste(x, out.view(x.shape).to(x.dtype))
