"""Token sampling for the native engine: pure tensor functions, no engine state.

What: temperature scaling, top-k / top-p / min-p truncation, greedy and seeded random sampling of one
token per row (the exponential race, argmax p / Exp(1)), and the fp32 log-probability of the sampled
token (before truncation, rollout/engine.py). Randomness is counter-based: a row's draws are a hash
of (its seed, how many draws it has made, the element), so a batch's noise is one batched tensor
computation instead of one generator call per row, and it needs no generator state on the device.
`sample_with_keys` is the whole sampler on device tensors (each row's draw key included), safe to
capture in a CUDA graph; `sample` draws the keys from the rows' `CounterRNG`s and calls it.
Invariants: a row's draw depends only on its seed, its draw count and its logits, never on the other
rows, so a seed reproduces it and a preempted sample redraws the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

# Design notes (moved from the module docstring)
# What: temperature scaling, top-k / top-p / min-p truncation, greedy and seeded random sampling
# of one token per row, and the fp32 log-probability of the sampled token.
#
# Why this shape:
# - Per-row randomness comes from the row's own `CounterRNG` (one per sample, seeded from the
#   request seed): draw n of a row is splitmix64(splitmix64(seed, n), element), so it depends only
#   on the seed and n, never on which other rows share the batch; results are reproducible given
#   the seed, and a preempted sample that is recomputed continues at the same n.
# - Random sampling is the exponential race: argmax_v p_v / q_v with q_v ~ Exp(1) i.i.d. picks v
#   with probability p_v (the Gumbel-max trick in another form); it needs no cumulative sums and
#   draws exactly V numbers per row per step.
# - Log-probabilities follow rollout/engine.py: log_softmax(logits / T) of the sampled token,
#   before truncation (T = 1 for greedy rows), in fp32.
#
# Legend: B rows (sequences sampled this step), V vocabulary.


def temperature_scaled(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """fp32 logits / T per row; greedy rows (T = 0) are left unscaled."""
    t_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    return logits_BV.float() / t_B.float()[:, None]


def truncation_mask(
    scaled_BV: torch.Tensor,
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [B, V]: tokens kept by top-k (0 = off), then top-p over the top-k renormalised
    distribution (1 = off), then min-p relative to the most likely token (0 = off). None turns
    a rule off for every row. The most likely token is always kept."""
    V = scaled_BV.shape[-1]
    if top_k_B is None and top_p_B is None and min_p_B is None:
        return torch.ones_like(scaled_BV, dtype=torch.bool)
    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(V, device=scaled_BV.device)
    keep_BV = torch.ones_like(sorted_BV, dtype=torch.bool)
    if top_k_B is not None:
        k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, V))
        keep_BV &= rank_V[None, :] < k_B[:, None]
    if top_p_B is not None:
        probs_BV = torch.softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
        before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # probability mass ranked above each token
        # top_p = 1 keeps everything even where the cumulative sum rounds to 1 before the tail.
        keep_BV &= (before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1)
    if min_p_B is not None:
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        keep_BV &= probs_BV >= min_p_B[:, None] * probs_BV[:, :1]
    keep_BV[:, 0] = True
    return torch.zeros_like(keep_BV).scatter(-1, order_BV, keep_BV)


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment and multipliers
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(z: int) -> int:
    """splitmix64's finalizer on an unsigned 64-bit Python int."""
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def splitmix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """`splitmix64` on int64 tensors (the same bits: wrapping multiplies, logical shifts by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _int64(_MIX1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _int64(_MIX2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


class CounterRNG:
    """A sample's random stream: `seed` and the number of draws made so far. Each call of
    `uniform_noise` / `exponential_noise` is one draw of the row (its elements share the draw)."""

    __slots__ = ("draws", "seed")

    def __init__(self, seed: int):
        if not -(1 << 63) <= seed < 1 << 63:
            raise ValueError(f"CounterRNG seed {seed} does not fit int64")
        self.seed, self.draws = int(seed), 0

    def next_key(self) -> int:
        """The key of the next draw (int64 bits of splitmix64(seed * golden + splitmix64(draws + golden)));
        element j of that draw is splitmix64(key + j * golden)."""
        inner = splitmix64((self.draws + _GOLDEN) & _M64)
        self.draws += 1
        return _int64(splitmix64(((self.seed & _M64) * _GOLDEN + inner) & _M64))


_OFFSETS: dict[tuple[int, str], torch.Tensor] = {}  # (n, device) -> arange(n) * golden, int64


def _element_offsets(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.arange(n, dtype=torch.int64, device=device) * _int64(_GOLDEN)
    return _OFFSETS[key]


def counter_noise_torch(
    keys_B: torch.Tensor, is_active_B: torch.Tensor, n: int, exponential: bool
) -> torch.Tensor:
    """fp32 [B, n]: row b is the draw of key keys_B[b] where is_active_B[b], element j being u = ((bits
    >> 40) + 0.5) / 2^24 with bits = splitmix64(key + j * golden), or -log u; inactive rows are 0
    (uniform) / 1 (exponential). The torch twin of model.kernels.triton_noise.counter_noise_triton."""
    bits_Bn = splitmix64_tensor(keys_B[:, None] + _element_offsets(n, keys_B.device))
    u_Bn = ((bits_Bn >> 40) & 0xFFFFFF).float().add_(0.5).mul_(2.0**-24)
    if exponential:
        return u_Bn.log_().neg_().masked_fill_(~is_active_B[:, None], 1.0)
    return u_Bn.masked_fill_(~is_active_B[:, None], 0.0)


def counter_noise(keys_B: torch.Tensor, is_active_B: torch.Tensor, n: int, exponential: bool) -> torch.Tensor:
    """The one dispatch point of the counter noise: the Triton kernel on CUDA, the torch twin elsewhere.
    Device tensors in, no host value read: safe inside a captured CUDA graph."""
    if keys_B.device.type == "cuda":
        from model.kernels.triton_noise import counter_noise_triton

        return counter_noise_triton(keys_B, is_active_B, n, exponential)
    return counter_noise_torch(keys_B, is_active_B, n, exponential)


_VECTOR_ROWS = 16  # from this many rows numpy draws the keys (a Python loop costs ~1 us per row)


def _splitmix64_np(z: np.ndarray) -> np.ndarray:
    """`splitmix64` on uint64 arrays (numpy's uint64 products wrap, as the & _M64 above)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def draw_keys(rngs: list[CounterRNG | None]) -> list[int]:
    """Each row's key of this step (0 for None rows, which draw nothing); in row order, so an rng
    shared by several rows gives each its next draw. Many distinct rngs: one vectorized `next_key`."""
    live = [r for r in rngs if r is not None]
    if len(live) < _VECTOR_ROWS or len({id(r) for r in live}) != len(live):
        return [0 if r is None else r.next_key() for r in rngs]
    seeds = np.array([r.seed & _M64 for r in live], dtype=np.uint64)
    draws = np.array([r.draws for r in live], dtype=np.uint64)
    inner = _splitmix64_np(draws + np.uint64(_GOLDEN))
    keys = iter(_splitmix64_np(seeds * np.uint64(_GOLDEN) + inner).view(np.int64).tolist())
    for r in live:
        r.draws += 1
    return [0 if r is None else next(keys) for r in rngs]


def _draw(rngs: list[CounterRNG | None], n: int, device: torch.device, exponential: bool) -> torch.Tensor:
    """[B, n] fp32: each active row's next draw (uniforms or Exp(1)); None rows are the fill."""
    keys = draw_keys(rngs)
    # keys and flags in one host-to-device copy
    packed_2B = torch.tensor([keys, [r is not None for r in rngs]], dtype=torch.int64).to(device)
    return counter_noise(packed_2B[0], packed_2B[1] != 0, n, exponential)


def uniform_noise(rngs: list[CounterRNG | None], n: int, device: torch.device) -> torch.Tensor:
    """[B, n] fp32 uniforms in (0, 1), row b from rngs[b]'s next draw; rows with None are zeros and
    consume nothing."""
    return _draw(rngs, n, device, exponential=False)


def exponential_noise(rngs: list[CounterRNG | None], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] i.i.d. Exp(1) draws (-log of the uniforms), row b from rngs[b]'s next draw; rows with
    None (greedy) are ones and consume no randomness."""
    return _draw(rngs, vocab_size, device, exponential=True)


def sample_with_keys(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    keys_B: torch.Tensor | None,
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
    banned_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row -> (tokens_B int64, logprobs_B fp32), from device tensors only: no host value
    is read and no branch depends on one, so a CUDA graph can capture it.

    Rows with temperature > 0 sample from the truncated temperature-scaled distribution with the
    draw of keys_B[b] (int64, their `CounterRNG.next_key()` of this step); rows with temperature 0
    take the argmax (first index on ties) and ignore their key. keys_B None: no row samples (every
    temperature 0), so no noise is drawn and truncation is skipped (it never moves an argmax).
    `banned_ids` (int64 [N]) are never drawn; like truncation they leave the log-prob, which is over
    the full vocabulary (rollout/engine.py), unchanged.
    """
    B, V = logits_BV.shape
    if temperature_B.shape != (B,) or (keys_B is not None and keys_B.shape != (B,)):
        got = f"{tuple(temperature_B.shape)} and {None if keys_B is None else tuple(keys_B.shape)}"
        raise ValueError(f"need temperature_B [{B}] and keys_B [{B}], got {got}")
    scaled_BV = temperature_scaled(logits_BV, temperature_B)
    drawn_BV = scaled_BV if banned_ids is None else scaled_BV.index_fill(-1, banned_ids, float("-inf"))
    tokens_B = drawn_BV.argmax(dim=-1)
    if keys_B is not None:
        is_random_B = temperature_B > 0
        keep_BV = truncation_mask(drawn_BV, top_k_B, top_p_B, min_p_B)
        probs_BV = torch.softmax(drawn_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
        q_BV = counter_noise(keys_B, is_random_B, V, exponential=True)
        tokens_B = torch.where(is_random_B, (probs_BV / q_BV).argmax(dim=-1), tokens_B)
    logprobs_B = torch.log_softmax(scaled_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
    return tokens_B, logprobs_B


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    rngs: list[CounterRNG | None],
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
    banned_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_with_keys` with each row's key drawn here from its rng (None rows draw nothing, and
    must be the greedy ones: temperature 0)."""
    B = logits_BV.shape[0]
    if len(rngs) != B:
        raise ValueError(f"need {B} rngs, got {len(rngs)}")
    keys_B = None
    if any(r is not None for r in rngs):
        keys_B = torch.tensor(draw_keys(rngs), dtype=torch.int64).to(logits_BV.device)
    return sample_with_keys(logits_BV, temperature_B, keys_B, top_k_B, top_p_B, min_p_B, banned_ids)
