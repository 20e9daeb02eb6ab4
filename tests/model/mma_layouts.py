"""The PTX ISA fragment layouts of mma.m16n8k16 (bf16): which (row, column) register i of lane
(g = lane // 4, t = lane % 4) holds, for the A (16 x 16), B (16 x 8) and C / D (16 x 8) operands. The CUDA
kernels' lane emulations (tests/model/test_cuda_moe.py, test_cuda_indexer.py) are written against these."""


def a_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i not in (0, 1, 4, 5)), 2 * t + (i & 1) + 8 * (i >= 4)


def b_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return 2 * t + (i & 1) + 8 * (i >= 2), g


def c_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i >= 2), 2 * t + (i & 1)
