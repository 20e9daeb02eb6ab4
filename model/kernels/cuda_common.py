"""Build and time the project's CUDA C++ kernels (cuda_moe.cu, cuda_indexer.cu).

What: `load_kernels` compiles a kernel file of this folder with torch's load_inline on first CUDA use
(cached under ~/.cache/torch_extensions; the shared device helpers come from cuda_nvfp4.cuh on the
include path); `graph_us` / `eager_us` time a call for the kernels' self-checks. Why one place: every
CUDA kernel is built the same way and timed the same way. Invariant: nothing here runs or compiles on
a CPU-only torch; importing it needs no CUDA.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

_HERE = Path(__file__).parent


@functools.cache
def load_kernels(stem: str, decl: str, functions: tuple[str, ...], capability: tuple[int, int]):
    """The compiled module of `<stem>.cu` for this GPU generation, binding `functions` (declared in
    `decl`, C++); the extension is named after the file and the architecture."""
    from torch.utils.cpp_extension import load_inline

    arch = f"{capability[0]}{capability[1]}"
    return load_inline(
        name=f"{stem}_v7_sm{arch}", cpp_sources=decl, cuda_sources=(_HERE / f"{stem}.cu").read_text(),
        functions=list(functions), extra_include_paths=[str(_HERE)],
        extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"],
    )  # fmt: skip


def graph_us(fn, reps: int) -> float:
    """Microseconds per call of `fn` captured once in a CUDA graph and replayed `reps` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def eager_us(fn, reps: int) -> float:
    """Microseconds per eager call (for baselines with host syncs, which a graph cannot hold)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps
