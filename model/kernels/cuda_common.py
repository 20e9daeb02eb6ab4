"""What the project's CUDA C++ kernels (cuda_moe.cu, cuda_gemv.cu, cuda_indexer.cu, cuda_attention.cu)
share on the Python side: build, device queries, launch scratch, operand checks, timing, test inputs.

What: `load_kernels` compiles a kernel file of this folder with torch's load_inline on first CUDA use
(cached under ~/.cache/torch_extensions; the shared device helpers come from cuda_nvfp4.cuh and
cuda_memory.cuh on the include path), after checking the GPU generation; `device_info` caches a
device's capability and SM count (the split plans' only device query); `split_counters` hands out the
zeroed ticket counters of the split reductions; `index_tensor` checks an int32 / int64 index operand;
`graph_us` / `eager_us` time a call for the kernels' self-checks; `random_nvfp4_rows` and
`ragged_tables` build the paged NVFP4 inputs the self-checks and tests share. Why one place: the
wrappers were written in parallel and each carried its own copy. Invariants: nothing here runs or
compiles on a CPU-only torch (importing it needs no CUDA); every kernel launch leaves its split
counters at 0, so one counter buffer per (device, stream) serves every kernel, launch after launch.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

_HERE = Path(__file__).parent


# ------------------------------------------------------------------------------------------ build
@functools.cache
def load_kernels(stem: str, decl: str, functions: tuple[str, ...], capability: tuple[int, int], *, op: str,
                 min_capability: tuple[int, int], needs: str):  # fmt: skip
    """The compiled module of `<stem>.cu` for this GPU generation, binding `functions` (declared in
    `decl`, C++); the extension is named after the file and the architecture. Raises RuntimeError
    naming `op` and what it `needs` below `min_capability`."""
    if capability < min_capability:
        need = f"sm_{min_capability[0]}{min_capability[1]}"
        raise RuntimeError(f"{op} needs {need}+ ({needs}), got {capability}")
    from torch.utils.cpp_extension import load_inline

    arch = f"{capability[0]}{capability[1]}"
    return load_inline(
        name=f"{stem}_v7_sm{arch}", cpp_sources=decl, cuda_sources=(_HERE / f"{stem}.cu").read_text(),
        functions=list(functions), extra_include_paths=[str(_HERE)],
        extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"],
    )  # fmt: skip


def device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device ("cuda" = the current one), cached."""
    return _device_info(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


# ------------------------------------------------------------------------------------------ launch
COUNTER_SLOTS, COUNTER_LEN = 8, 1 << 16  # streams per device with a pre-zeroed slot, counters per slot
_COUNTER_POOLS: dict[str, torch.Tensor] = {}
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 ticket counters (>= n) for the split reductions of cuda_moe, cuda_gemv and
    cuda_attention, one buffer per (device, stream) so that launches on two streams never share one,
    kept between calls: every launch leaves its counters at 0. A new stream takes the next slot of a
    device pool zeroed on the device's first call, so a capture on a fresh stream (torch.cuda.graph's
    side stream) allocates and zeroes nothing inside the graph; past COUNTER_SLOTS streams or
    COUNTER_LEN counters a buffer of its own (warm up on the capture stream)."""
    if device.index is None:  # "cuda" and "cuda:0" must share one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        pool = _COUNTER_POOLS.get(key[0])
        if pool is None:
            pool = _COUNTER_POOLS[key[0]] = torch.zeros(COUNTER_SLOTS, COUNTER_LEN, dtype=torch.int32,
                                                        device=device)  # fmt: skip
        used = sum(1 for k in _COUNTERS if k[0] == key[0])
        if buf is None and used < COUNTER_SLOTS and n <= COUNTER_LEN:
            buf = pool[used]
        else:
            buf = torch.zeros(max(n, COUNTER_LEN), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def index_tensor(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """An int32 / int64 index operand (block tables, sequence ids, positions, selections) as the
    kernels read it: unit last stride (a copy where not). Raises ValueError naming `op` and `name`."""
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be int32 or int64, got {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


# ------------------------------------------------------------------------------------------ self-checks
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


def random_nvfp4_rows(shape: tuple[int, ...], device, gen: torch.Generator, special: bool = False,
                      head_dim: int = 128) -> torch.Tensor:  # fmt: skip
    """Random packed NVFP4 cache rows uint8 [*shape, head_dim / 2 + head_dim / 16] (codes, then e4m3
    block scales): every code; scales in [4, 64], or (special) every non-NaN e4m3 byte 0x00-0x7E
    (zero, the subnormals 0x01-0x07, 448 = 0x7E). Index pages are [pages, page], K / V pages
    [pages, 2N, page]."""
    packed = torch.randint(0, 256, (*shape, head_dim // 2), generator=gen, device=device, dtype=torch.uint8)
    if special:
        sbytes = torch.randint(0, 0x7F, (*shape, head_dim // 16), generator=gen, device=device,
                               dtype=torch.uint8)  # fmt: skip
    else:
        scales = torch.rand(*shape, head_dim // 16, generator=gen, device=device) * 60 + 4
        sbytes = scales.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([packed, sbytes], dim=-1)


def ragged_tables(lens: list[int], page: int, gen: torch.Generator, spare_cols: int = 1,
                  spare_pages: int = 1) -> tuple[torch.Tensor, int]:  # fmt: skip
    """Block tables int32 [B, max pages + spare_cols] over shuffled page ids, -1 padded, for sequences
    of `lens` tokens, and the page count (`spare_pages` unused pages besides): the tests' and the
    self-checks' paged layouts."""
    n_used = [-(-int(n) // page) for n in lens]
    n_pages = sum(n_used) + spare_pages
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.full((len(lens), max(n_used) + spare_cols), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_used):
        table[b, :n] = perm[at : at + n].int()
        at += n
    return table, n_pages
