"""What the CUDA kernels' lane emulations (tests/model/test_cuda_moe.py, test_cuda_gemv.py,
test_cuda_indexer.py, test_cuda_attention.py) share: the PTX ISA fragment layouts of mma.m16n8k16
(bf16), the 64-input chunk map of cuda_moe.cu / cuda_gemv.cu, the device helpers' bit operations
(prmt, the NVFP4 decode of cuda_nvfp4.cuh) on int64 tensors, and the special-value inputs.

Layouts: register i of lane (g = lane // 4, t = lane % 4) holds (row, column) `a_row_col` of A
(16 x 16; a_{2n} in the low half of 32-bit register n), `b_row_col` of B (16 x 8) and `c_row_col` of
C / D (16 x 8). The decode emulation checks, at every step, that each bf16 value is exact (the
kernels' invariant), so an emulation that passes proves the kernels' bf16 arithmetic loses nothing.
"""

import torch

MASK32 = 0xFFFFFFFF
DECODE_MASK = 0x81C081C0  # bf16 sign, exponent bits 7-8, mantissa msb of both halves


# ------------------------------------------------------------------------------- layouts (PTX ISA)
def a_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i not in (0, 1, 4, 5)), 2 * t + (i & 1) + 8 * (i >= 4)


def b_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return 2 * t + (i & 1) + 8 * (i >= 2), g


def c_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i >= 2), 2 * t + (i & 1)


def kappa_to_k(kappa: int, step: int, t: int) -> int:
    """cuda_moe.cu / cuda_gemv.cu: the input (within a 64-wide chunk) at MMA column kappa of k-step
    `step` (0..3) for lanes of thread-in-group t, A and B alike: lane t holds NVFP4 block t."""
    return 16 * t + 8 * (step >> 1) + 2 * (step & 1) + (kappa >= 8) + 4 * (kappa & 1)


# ------------------------------------------------------------------------------- bit operations
def u32(rows_u8: torch.Tensor, offset: int) -> torch.Tensor:
    """Little-endian 32-bit word at byte `offset` of each row: bytes [..., n] -> int64 [...]."""
    b = rows_u8[..., offset : offset + 4].long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def byte_perm(x, y, sel: int):
    """CUDA __byte_perm / PTX prmt (default mode): result byte n = byte (sel >> 4n) & 7 of the 8 bytes
    {y : x} (x the low four). On ints or int64 tensors of 32-bit values."""
    both = [(x >> (8 * n)) & 0xFF for n in range(4)] + [(y >> (8 * n)) & 0xFF for n in range(4)]
    out = 0
    for n in range(4):
        out = out | (both[(sel >> (4 * n)) & 7] << (8 * n))
    return out


def bf16_halves(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 32-bit registers -> (low, high) bf16 halves as fp64 values (subnormals kept)."""
    to = lambda h: (h << 16).to(torch.int32).view(torch.float32).double()
    return to(r & 0xFFFF), to((r >> 16) & 0xFFFF)


def is_bf16(v: torch.Tensor) -> bool:
    """Whether every fp64 value is exactly a bf16 value."""
    as_f32 = v.float().double()
    return bool(torch.equal(v.float().to(torch.bfloat16).double(), v)) and bool(torch.equal(as_f32, v))


def b_fragments(words) -> list[list]:
    """cuda_nvfp4.cuh `b_fragments`: the 8 words of 16 bf16 values (word m = values 2m (low), 2m + 1)
    -> [k-step i][register j] B registers, j = 0: values o, o + 4, j = 1: o + 1, o + 5, o = 8 (i >> 1)
    + 2 (i & 1). Ints or int64 tensors."""
    out = []
    for i in range(4):
        lo, hi = words[4 * (i >> 1) + (i & 1)], words[4 * (i >> 1) + (i & 1) + 2]
        out.append([byte_perm(lo, hi, 0x5410), byte_perm(lo, hi, 0x7632)])
    return out


# ------------------------------------------------------------------------------- NVFP4 decode
def scale_x2119(byte: torch.Tensor) -> torch.Tensor:
    """cuda_nvfp4.cuh `scale_splats` / `scale_pair` of one e4m3 scale byte: s * 2^119 (fp64), checked
    to be a bf16 value (what the bf16x2 multiplier holds)."""
    v = byte.to(torch.uint8).view(torch.float8_e4m3fn).double() * 2.0**119
    assert is_bf16(v), "s * 2^119 must be a bf16"
    return v


def nibble_pair(q: torch.Tensor, odd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cuda_nvfp4.cuh `nibble_pair`: nibble 0 (odd = 0) or 1 of each 16-bit half of q -> (low, high)
    fp64 values of the bf16x2 register (e2m1 * 2^-126)."""
    raw = ((q & 0x00F000F0) * 0x0104) if odd else ((q & 0x000F000F) * 0x1040)
    return bf16_halves(raw & DECODE_MASK & MASK32)


def bmul(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`bmul2` on one half: the bf16 product, checked exact."""
    out = v * s
    assert is_bf16(out), "the bf16x2 multiply must be exact"
    return out


def decode_a(qg: torch.Tensor, qg8: torch.Tensor, s_g: torch.Tensor, s_g8: torch.Tensor) -> list[tuple]:
    """cuda_nvfp4.cuh `decode_a` on int64 code words of rows g / g + 8 (already >> 8 for nibbles 2, 3,
    6, 7) and the rows' multipliers s * 2^119 (`scale_x2119`): [(low, high)] fp64 values of A
    registers 0..3 = e2m1 * s * 2^-7."""
    regs = []
    for q, s, odd in ((qg, s_g, 0), (qg8, s_g8, 0), (qg, s_g, 1), (qg8, s_g8, 1)):
        lo, hi = nibble_pair(q, odd)
        regs.append((bmul(lo, s), bmul(hi, s)))
    return regs


# ------------------------------------------------------------------------------- special inputs
def special_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, 72] NVFP4 cache rows (64 code bytes, 8 scale bytes): random codes (all 16 appear),
    scale bytes covering every non-NaN e4m3 byte (0, the subnormals 0x01-0x07, 448 = 0x7E, negative
    scales 0x80-0xFE too)."""
    rows = torch.randint(0, 256, (n, 72), generator=gen, dtype=torch.uint8)
    sb = rows[:, 64:]
    sb[(sb & 0x7F) == 0x7F] = 0x7E  # no NaN
    sb[:2] = torch.tensor([0, 1, 2, 3, 5, 7, 0x7E, 0x08, 0x80, 0xFE, 0x81, 0x06, 0x7D, 0x40, 0x38, 0x00],
                          dtype=torch.uint8).view(2, 8)  # fmt: skip
    return rows


def special_weights(rows: tuple[int, ...], n_in: int, gen: torch.Generator):
    """NVFP4 weights of n_in inputs per row (rows: [E, N] or [N]) in canonical storage: packed uint8
    [*rows, n_in / 2] with random codes (all 16 appear) and e4m3 scales [*rows, n_in / 16] covering
    the subnormals (0x01-0x07), 0 and 448."""
    packed = torch.randint(0, 256, (*rows, n_in // 2), generator=gen, dtype=torch.uint8)
    sbytes = torch.randint(0, 0x7F, (*rows, n_in // 16), generator=gen, dtype=torch.uint8)  # 0x7F is NaN
    sbytes.view(-1)[:8] = torch.tensor([0, 1, 2, 3, 5, 7, 0x7E, 0x08], dtype=torch.uint8)
    return packed, sbytes.view(torch.float8_e4m3fn)
