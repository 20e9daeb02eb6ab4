"""Paged KV storage for one model: main K/V pages per attention layer, index-key pages per sparse
layer, in fp32 / bf16 / fp8 (e4m3) / NVFP4 / NVFP4 with 4-over-6 block scales.

Why paged: the engine shares and rolls back sequences at page granularity; the page size equals the
MSA block size, so a selected sparse block is exactly one page. Token position p lives at slot
block_table[p // page] * page_size + p % page. NVFP4 rows are vLLM's MiniMax-M3 layout (docs/FACTS.md,
"NVFP4 KV cache"); one static fp32 dequant-side scale per layer and side, set with `set_scales`.

Invariants: `gather` returns exactly `kv_quant_dequant` of the appended values (the training-side
simulation is the same function bit for bit); rollback is the caller keeping a shorter length (stale
slots are never read and are overwritten by the next append); no host syncs in append / gather; the
Triton append (`model.kernels.triton_kv_append`: one launch stores a layer's K, V and index keys in
fp32 / bf16 / fp8 / NVFP4) is byte-identical to `quantize_kv` for finite inputs; under
`static_shapes()` (padded decode, CUDA-graph capture) the paged ops size their work from host-known
bounds (table width x page).
"""

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from model import nvfp4
from model.config import ModelConfig

# Layouts (P pages, N kv heads, C head dim, Ci index head dim, page = page_size):
# - main K/V: [P, 2N, page, X], slot 2*head + side (0 = K, 1 = V); X = C for fp32/bf16/fp8 (fp8 as
#   raw e4m3 bytes in uint8) and C/2 + C/16 for NVFP4 (packed E2M1, then e4m3 block scales: 72 B at
#   C = 128). "nvfp4_4over6" has the same layout and dequantization; only the writer differs (each
#   16-value block keeps the max/6 or max/4 scale with the smaller squared error), so any NVFP4
#   reader, vLLM included, serves its pages unchanged.
# - index keys (sparse layers only): [P, page, Xi], one shared head, same per-dtype rule.
# Scales: fp8 stores e4m3(clamp(x / scale, +-448)); NVFP4 uses `scale` as scale_2 (amax / 2688) and
# computes block scales per token at append. Defaults are DEFAULT_KV_SCALE (1.0, vLLM's uncalibrated
# default); the attention module's `k_scale` / `v_scale` / `index_k_scale` buffers are the source.

try:  # Triton is optional on CPU machines: without it appends take the torch path.
    from model.kernels.triton_common import triton_available
    from model.kernels.triton_kv_append import APPEND_DTYPES, kv_append
except ImportError:  # pragma: no cover - depends on the install
    triton_available = None

KVDtype = Literal["fp32", "bf16", "fp8", "nvfp4", "nvfp4_4over6"]
NVFP4_DTYPES = ("nvfp4", "nvfp4_4over6")  # one storage layout, one dequantization
DEFAULT_KV_SCALE = 1.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_TORCH_STORAGE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8": torch.uint8,
    "nvfp4": torch.uint8,
    "nvfp4_4over6": torch.uint8,
}


def check_kv_dtype(name: str, dtype: str) -> None:
    if dtype not in get_args(KVDtype):
        raise ValueError(f"{name}={dtype!r} is not a KV cache dtype; choose one of {list(get_args(KVDtype))}")


def stored_width(dtype: KVDtype, head_dim: int) -> int:
    """Length of the last (per-head, per-token) dim of a stored row."""
    if dtype in NVFP4_DTYPES:
        if head_dim % 16:
            raise ValueError(f"an nvfp4 cache needs head_dim % 16 == 0, got {head_dim}")
        return head_dim // 2 + head_dim // 16
    return head_dim


def quantize_kv(x: torch.Tensor, dtype: KVDtype, scale: torch.Tensor) -> torch.Tensor:
    """Stored form of `x` [..., N, C] (float): [..., N, X] in the cache's storage dtype."""
    if dtype == "fp32":
        return x.to(torch.float32)
    if dtype == "bf16":
        return x.to(torch.bfloat16)
    if dtype == "fp8":
        scaled = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)  # e4m3fn has no inf: clamp first
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    lead = x.shape[:-2]
    # check_finite=False: the NaN check is a host sync, and append is on the decode hot path.
    is_4over6 = dtype == "nvfp4_4over6"
    x_RNC = x.reshape(-1, *x.shape[-2:]).float()
    packed = nvfp4.kv_quantize(x_RNC, scale, four_over_six=is_4over6, check_finite=False)
    return packed.reshape(*lead, *packed.shape[-2:])


def dequantize_kv(
    stored: torch.Tensor, dtype: KVDtype, scale: torch.Tensor, head_dim: int, out_dtype=torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_kv`: stored [..., N, X] -> values [..., N, head_dim] in `out_dtype`."""
    if dtype in ("fp32", "bf16"):
        return stored.to(out_dtype)
    if dtype == "fp8":
        return (stored.view(torch.float8_e4m3fn).float() * scale).to(out_dtype)
    lead = stored.shape[:-2]
    values = nvfp4.kv_dequantize(stored.reshape(-1, *stored.shape[-2:]), scale, torch.float32)
    return values.reshape(*lead, *stored.shape[-2:-1], head_dim).to(out_dtype)


def kv_quant_dequant(x: torch.Tensor, dtype: KVDtype, scale: torch.Tensor) -> torch.Tensor:
    """What the cache gives back for `x` [..., N, C], in x's dtype (training-side simulation).

    NVFP4 (either writer) goes through `model.nvfp4.kv_quant_dequant` (equal to its quantize ->
    dequantize round trip bit for bit, without packing). Use it on detached values:
    `model.layers.attention` wraps it in a straight-through estimator."""
    if dtype in NVFP4_DTYPES:
        return nvfp4.kv_quant_dequant(x, scale, four_over_six=dtype == "nvfp4_4over6", check_finite=False)
    return dequantize_kv(quantize_kv(x, dtype, scale), dtype, scale, x.shape[-1], out_dtype=x.dtype)


def _triton_append_ok(dtype: KVDtype, x: torch.Tensor) -> bool:
    """The fused Triton append serves fp32 / bf16 / fp8 / plain NVFP4 caches (the 4-over-6 writer stays
    on the torch path) on CUDA, or on the CPU under TRITON_INTERPRET=1, for rows contiguous in their
    last dim."""
    return (
        triton_available is not None
        and dtype in APPEND_DTYPES
        and triton_available(x)
        and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


_STATIC = threading.local()


@contextmanager
def static_shapes() -> Iterator[None]:
    """Within: no op of the decode path reads device values on the host (capture-safe fixed shapes)."""
    before = getattr(_STATIC, "on", False)
    _STATIC.on = True
    try:
        yield
    finally:
        _STATIC.on = before


def is_static_shapes() -> bool:
    """True inside `static_shapes()` or while the current CUDA stream is capturing a graph."""
    if getattr(_STATIC, "on", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def max_len_bound(seq_lens_B: torch.Tensor, block_tables_BP: torch.Tensor, page_size: int) -> int:
    """Keys to gather per sequence: the longest length (one host sync), or under `static_shapes()` the
    block tables' capacity (no sync; the extra slots are masked as invalid by the callers)."""
    if is_static_shapes():
        return block_tables_BP.shape[1] * page_size
    return int(seq_lens_B.max())  # SYNC: sizes the gathered keys, once per call


def slot_mapping(
    block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Cache slot (page_id * page_size + offset) of every token, from its sequence and position."""
    page_T = block_tables_BP[seq_idx_T, positions_T // page_size].long()
    return page_T * page_size + positions_T % page_size


@dataclass(frozen=True)
class PagedKV:
    """One layer's main K/V pages as the attention op reads them."""

    pages: torch.Tensor  # [P, 2N, page, X]
    dtype: KVDtype
    k_scale: torch.Tensor  # fp32 0-d, dequant side
    v_scale: torch.Tensor
    head_dim: int


@dataclass(frozen=True)
class PagedIndex:
    """One sparse layer's index-key pages as the indexer op reads them."""

    pages: torch.Tensor  # [P, page, Xi]
    dtype: KVDtype
    scale: torch.Tensor  # fp32 0-d, dequant side
    head_dim: int


def kv_append_ref(
    slot_mapping_T: torch.Tensor,
    kv: PagedKV | None,
    k_TNC: torch.Tensor | None,
    v_TNC: torch.Tensor | None,
    index: PagedIndex | None = None,
    index_k_TC: torch.Tensor | None = None,
) -> None:
    """The append in torch (the spec of `triton_kv_append.kv_append`, same arguments): `quantize_kv`
    each part and scatter it to its slots (K to row 2n, V to 2n + 1 of the main pages)."""
    slot_T = slot_mapping_T.long()
    if kv is not None:
        page_size = kv.pages.shape[2]
        page_T, off_T = slot_T // page_size, slot_T % page_size
        heads_N = torch.arange(k_TNC.shape[1], device=kv.pages.device) * 2
        for side, x_TNC, scale in ((0, k_TNC, kv.k_scale), (1, v_TNC, kv.v_scale)):
            stored = quantize_kv(x_TNC, kv.dtype, scale)
            kv.pages[page_T[:, None], heads_N[None, :] + side, off_T[:, None]] = stored
    if index is not None:
        page_size = index.pages.shape[1]
        page_T, off_T = slot_T // page_size, slot_T % page_size
        index.pages[page_T, off_T] = quantize_kv(index_k_TC[:, None, :], index.dtype, index.scale)[:, 0]


def gather_pages(pages: torch.Tensor, block_table_P: torch.Tensor, length: int) -> torch.Tensor:
    """Token-major stored rows of one sequence: pages [P, page, ...] -> [length, ...]."""
    page_size = pages.shape[1]
    n_pages = -(-length // page_size)
    if n_pages > block_table_P.shape[0]:
        raise ValueError(
            f"length {length} needs {n_pages} pages but the block table holds {block_table_P.shape[0]}"
        )
    rows = pages[block_table_P[:n_pages].long()]  # [n_pages, page, ...]
    return rows.reshape(n_pages * page_size, *pages.shape[2:])[:length]


# Bytes of gathered keys per token chunk in the ops' batched torch paths (bounds their peak memory).
GATHER_CHUNK_BYTES = 64 << 20


def gather_sequences(
    pages: torch.Tensor, block_tables_BP: torch.Tensor, seq_lens_B: torch.Tensor, S: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows of every sequence, padded to S: pages [P, page, ...] -> ([B, S, ...], valid [B, S]).
    Slots past a sequence's length (stale or never written) are flagged invalid for the caller to zero."""
    B, page = block_tables_BP.shape[0], pages.shape[1]
    n_pages = -(-S // page)
    table = block_tables_BP[:, :n_pages].long().clamp(min=0)  # unused slots may hold -1
    rows = pages[table].reshape(B, n_pages * page, *pages.shape[2:])[:, :S]
    valid_BS = torch.arange(S, device=pages.device) < seq_lens_B[:, None]
    return rows, valid_BS


class KVCache:
    """Paged K/V (+ index key) storage for every attention layer of one model.

    `dtype` (if given) sets the main K/V dtype of every layer, ignoring the config's per-layer
    overrides; None takes config.kv_dtype_for_layer(i). `index_dtype` likewise overrides
    config.index_cache_dtype. Pages start zeroed.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        device: torch.device | str = "cpu",
        dtype: KVDtype | None = None,
        index_dtype: KVDtype | None = None,
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.config = config
        self.num_pages = num_pages
        self.page_size = config.index_block_size
        # Tokens one block-table entry (one scheduler page) covers: a page here; a DCP shard's entry
        # stands for one page on each of its W ranks (model.parallel.context_parallel.DCPKVCache).
        self.table_page_size = self.page_size
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.index_head_dim = config.index_head_dim
        n_layers = config.num_hidden_layers
        if dtype is not None:
            check_kv_dtype("dtype", dtype)
        if index_dtype is not None:
            check_kv_dtype("index_dtype", index_dtype)
        self.kv_dtypes: list[KVDtype] = [dtype or config.kv_dtype_for_layer(i) for i in range(n_layers)]
        self.index_dtype: KVDtype = index_dtype or config.index_cache_dtype
        # [L, 3]: dequant-side scales (k, v, index) per layer.
        self.scales = torch.full((n_layers, 3), DEFAULT_KV_SCALE, dtype=torch.float32, device=device)
        self.kv: list[torch.Tensor] = []
        self.index: list[torch.Tensor | None] = []
        for i in range(n_layers):
            width = stored_width(self.kv_dtypes[i], self.head_dim)
            shape = (num_pages, 2 * self.num_kv_heads, self.page_size, width)
            self.kv.append(torch.zeros(shape, dtype=_TORCH_STORAGE[self.kv_dtypes[i]], device=device))
            if config.is_sparse_layer(i):
                iw = stored_width(self.index_dtype, self.index_head_dim)
                ishape = (num_pages, self.page_size, iw)
                self.index.append(torch.zeros(ishape, dtype=_TORCH_STORAGE[self.index_dtype], device=device))
            else:
                self.index.append(None)

    # --------------------------------------------------------------------------- scales
    def set_scales(
        self,
        layer: int,
        k_scale: float | torch.Tensor,
        v_scale: float | torch.Tensor,
        index_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Set the static dequant-side scales of `layer` (before its first append)."""
        self.scales[layer, 0] = torch.as_tensor(k_scale, dtype=torch.float32)
        self.scales[layer, 1] = torch.as_tensor(v_scale, dtype=torch.float32)
        if index_scale is not None:
            self.scales[layer, 2] = torch.as_tensor(index_scale, dtype=torch.float32)

    # --------------------------------------------------------------------------- views
    def kv_view(self, layer: int) -> PagedKV:
        return PagedKV(self.kv[layer], self.kv_dtypes[layer], self.scales[layer, 0], self.scales[layer, 1],
                       self.head_dim)  # fmt: skip

    def index_view(self, layer: int) -> PagedIndex:
        pages = self.index[layer]
        if pages is None:
            raise ValueError(f"layer {layer} is a full-attention layer: it has no index cache")
        return PagedIndex(pages, self.index_dtype, self.scales[layer, 2], self.index_head_dim)

    # --------------------------------------------------------------------------- write
    def append(
        self,
        layer: int,
        slot_mapping_T: torch.Tensor,
        k_TNC: torch.Tensor,
        v_TNC: torch.Tensor,
        index_k_TC: torch.Tensor | None = None,
    ) -> None:
        """Store T tokens' K/V (and index keys on sparse layers) at their slots (all >= 0)."""
        N, C = self.num_kv_heads, self.head_dim
        if slot_mapping_T.ndim != 1 or slot_mapping_T.is_floating_point():
            got = f"{tuple(slot_mapping_T.shape)} {slot_mapping_T.dtype}"
            raise ValueError(f"slot_mapping_T must be a 1-D integer tensor, got {got}")
        T = slot_mapping_T.shape[0]
        for name, x in (("k_TNC", k_TNC), ("v_TNC", v_TNC)):
            if tuple(x.shape) != (T, N, C):
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (T={T}, N={N}, C={C})")
        is_sparse = self.index[layer] is not None
        if is_sparse and index_k_TC is None:
            raise ValueError(f"layer {layer} is sparse: append needs index_k_TC [T, {self.index_head_dim}]")
        if not is_sparse and index_k_TC is not None:
            raise ValueError(f"layer {layer} is a full-attention layer (no index cache): pass no index_k_TC")
        if is_sparse and tuple(index_k_TC.shape) != (T, self.index_head_dim):
            raise ValueError(f"index_k_TC has shape {tuple(index_k_TC.shape)}, expected "
                             f"(T={T}, Ci={self.index_head_dim})")  # fmt: skip
        kv_dtype = self.kv_dtypes[layer]
        # One launch stores every part the Triton kernel writes (K, V and the index key in the common
        # case); a part it does not (the 4-over-6 writer, no Triton) takes the torch path below.
        use_kv = _triton_append_ok(kv_dtype, k_TNC) and _triton_append_ok(kv_dtype, v_TNC)
        use_kv = use_kv and k_TNC.dtype == v_TNC.dtype
        use_index = is_sparse and _triton_append_ok(self.index_dtype, index_k_TC)
        if use_kv or use_index:
            kv_view = self.kv_view(layer) if use_kv else None
            index_view = self.index_view(layer) if use_index else None
            kv_append(slot_mapping_T, kv_view, k_TNC, v_TNC, index_view, index_k_TC)
        if use_kv and (use_index or not is_sparse):
            return
        # Torch path for the parts the kernel did not write (slot -> page, offset only here).
        index_view = self.index_view(layer) if is_sparse and not use_index else None
        kv_append_ref(
            slot_mapping_T, None if use_kv else self.kv_view(layer), k_TNC, v_TNC, index_view, index_k_TC
        )

    # --------------------------------------------------------------------------- read
    def gather(
        self, layer: int, block_table_P: torch.Tensor, length: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V [length, N, C] of one sequence's first `length` positions."""
        view = self.kv_view(layer)
        rows = gather_pages(view.pages.transpose(1, 2), block_table_P, length)  # [S, 2N, X]
        k_SNC = dequantize_kv(rows[:, 0::2], view.dtype, view.k_scale, self.head_dim, dtype)
        v_SNC = dequantize_kv(rows[:, 1::2], view.dtype, view.v_scale, self.head_dim, dtype)
        return k_SNC, v_SNC

    def gather_index(
        self, layer: int, block_table_P: torch.Tensor, length: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Dequantized index keys [length, Ci] of one sequence."""
        view = self.index_view(layer)
        rows = gather_pages(view.pages, block_table_P, length)  # [S, Xi]
        return dequantize_kv(rows[:, None], view.dtype, view.scale, view.head_dim, dtype)[:, 0]

    # --------------------------------------------------------------------------- sizes, sharing
    def bytes_per_token(self, layer: int) -> int:
        """Main K/V bytes one token occupies in `layer` (what docs/FACTS.md, "Headline figures" counts)."""
        t = self.kv[layer]
        return t.shape[1] * t.shape[3] * t.element_size()

    def index_bytes_per_token(self, layer: int) -> int:
        t = self.index[layer]
        return 0 if t is None else t.shape[2] * t.element_size()

    def total_bytes_per_token(self) -> int:
        n = len(self.kv)
        return sum(self.bytes_per_token(i) + self.index_bytes_per_token(i) for i in range(n))

    def copy_pages(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy whole pages src[i] -> dst[i] in every layer (copy-on-write prefix sharing)."""
        src_t = torch.as_tensor(src, dtype=torch.long, device=self.kv[0].device)
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=self.kv[0].device)
        if src_t.shape != dst_t.shape or src_t.ndim != 1:
            raise ValueError(f"src and dst must be 1-D and of equal length, got {tuple(src_t.shape)} "
                             f"and {tuple(dst_t.shape)}")  # fmt: skip
        for pages in [*self.kv, *(t for t in self.index if t is not None)]:
            pages[dst_t] = pages[src_t]
