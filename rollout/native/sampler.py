"""Token sampling for the native engine: pure tensor functions, no engine state.

What: temperature scaling, top-k / top-p / min-p truncation, greedy and seeded random sampling of one
token per row (the exponential race, argmax p / Exp(1)), and the fp32 log-probability of the sampled
token (before truncation, rollout/engine.py). Randomness is counter-based: a row's draws are a hash
of (its seed, how many draws it has made, the element), so a batch's noise is one batched tensor
computation instead of one generator call per row, and it needs no generator state on the device.
Invariants: a row's draw depends only on its seed, its draw count and its logits, never on the other
rows, so a seed reproduces it and a preempted sample redraws the same tokens.
"""

from __future__ import annotations

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


def _draw(rngs: list[CounterRNG | None], n: int, device: torch.device, exponential: bool) -> torch.Tensor:
    """[B, n] fp32: each active row's next draw as uniforms in (0, 1) (24 random bits: (k + 0.5) /
    2^24), or their -log (Exp(1)); inactive rows (None) are 0 (uniform) / 1 (exponential)."""
    B = len(rngs)
    rows = [b for b, r in enumerate(rngs) if r is not None]
    fill = 1.0 if exponential else 0.0
    if not rows:
        return torch.full((B, n), fill, dtype=torch.float32, device=device)
    # (row, key) pairs in one host-to-device copy; in row order, so an rng shared by several rows
    # gives each its next draw.
    row_key_R2 = torch.tensor([(b, rngs[b].next_key()) for b in rows], dtype=torch.int64).to(device)
    out_Bn = torch.full((B, n), fill, dtype=torch.float32, device=device)
    if device.type == "cuda":
        from model.kernels.triton_noise import counter_noise_triton

        counter_noise_triton(row_key_R2, out_Bn, exponential)
    else:
        counter_noise_torch(row_key_R2, out_Bn, exponential)
    return out_Bn


def counter_noise_torch(row_key_R2: torch.Tensor, out_Bn: torch.Tensor, exponential: bool) -> None:
    """Row row_key_R2[r, 0] of `out_Bn` from the draw key row_key_R2[r, 1]: element j is u = ((bits >> 40)
    + 0.5) / 2^24 with bits = splitmix64(key + j * golden), or -log u; the torch twin of
    model.kernels.triton_noise.counter_noise_triton (the other rows are left as they are)."""
    bits_Rn = splitmix64_tensor(row_key_R2[:, 1:] + _element_offsets(out_Bn.shape[1], out_Bn.device))
    u_Rn = ((bits_Rn >> 40) & 0xFFFFFF).float().add_(0.5).mul_(2.0**-24)
    out_Bn[row_key_R2[:, 0]] = u_Rn.log_().neg_() if exponential else u_Rn


def uniform_noise(rngs: list[CounterRNG | None], n: int, device: torch.device) -> torch.Tensor:
    """[B, n] fp32 uniforms in (0, 1), row b from rngs[b]'s next draw; rows with None are zeros and
    consume nothing."""
    return _draw(rngs, n, device, exponential=False)


def exponential_noise(rngs: list[CounterRNG | None], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] i.i.d. Exp(1) draws (-log of the uniforms), row b from rngs[b]'s next draw; rows with
    None (greedy) are ones and consume no randomness."""
    return _draw(rngs, vocab_size, device, exponential=True)


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    rngs: list[CounterRNG | None],
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row -> (tokens_B int64, logprobs_B fp32).

    Rows with temperature 0 take the argmax (first index on ties) and must have rng None; the
    others sample from the truncated temperature-scaled distribution with their rng's next draw.
    """
    B, V = logits_BV.shape
    if temperature_B.shape != (B,) or len(rngs) != B:
        raise ValueError(f"need temperature_B [{B}] and {B} rngs, got "
                         f"{tuple(temperature_B.shape)} and {len(rngs)}")  # fmt: skip
    scaled_BV = temperature_scaled(logits_BV, temperature_B)
    if all(g is None for g in rngs):  # every row greedy: no draw, no truncation
        tokens_B = scaled_BV.argmax(dim=-1)
        return tokens_B, torch.log_softmax(scaled_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
    keep_BV = truncation_mask(scaled_BV, top_k_B, top_p_B, min_p_B)
    probs_BV = torch.softmax(scaled_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    q_BV = exponential_noise(rngs, V, logits_BV.device)
    random_B = (probs_BV / q_BV).argmax(dim=-1)
    greedy_B = scaled_BV.argmax(dim=-1)
    tokens_B = torch.where(temperature_B > 0, random_B, greedy_B)
    logprobs_B = torch.log_softmax(scaled_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
    return tokens_B, logprobs_B
