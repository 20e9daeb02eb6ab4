"""Token sampling for the native engine: pure tensor functions, no engine state.

What: temperature scaling, top-k / top-p / min-p truncation, greedy and seeded random sampling of one
token per row (the exponential race, argmax p / Exp(1), drawn from each row's own generator), and the
fp32 log-probability of the sampled token (before truncation, rollout/engine.py).
Invariants: a row's draw depends only on its generator and its logits, never on the other rows, so a
seed reproduces it and a preempted sample redraws the same tokens.
"""

from __future__ import annotations

import torch

# Design notes (moved from the module docstring)
# What: temperature scaling, top-k / top-p / min-p truncation, greedy and seeded random sampling
# of one token per row, and the fp32 log-probability of the sampled token.
#
# Why this shape:
# - Per-row randomness comes from the row's own `torch.Generator` (one per sample, seeded from
#   the request seed): a row's draw depends only on its generator's state and its logits, never
#   on which other rows share the batch, so results are reproducible given the seed, and a
#   preempted sample that is recomputed draws the same tokens.
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


def exponential_noise(
    generators: list[torch.Generator | None], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] i.i.d. Exp(1) draws, row b from generators[b]; rows with None (greedy) are ones and
    consume no randomness."""
    q_BV = torch.ones((len(generators), vocab_size), dtype=torch.float32, device=device)
    for b, gen in enumerate(generators):
        if gen is not None:
            q_BV[b].exponential_(generator=gen)
    return q_BV


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    generators: list[torch.Generator | None],
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row -> (tokens_B int64, logprobs_B fp32).

    Rows with temperature 0 take the argmax (first index on ties) and must have generator None;
    the others sample from the truncated temperature-scaled distribution with their generator.
    """
    B, V = logits_BV.shape
    if temperature_B.shape != (B,) or len(generators) != B:
        raise ValueError(f"need temperature_B [{B}] and {B} generators, got "
                         f"{tuple(temperature_B.shape)} and {len(generators)}")  # fmt: skip
    scaled_BV = temperature_scaled(logits_BV, temperature_B)
    if all(g is None for g in generators):  # every row greedy: skip the random draw's ~10 launches
        tokens_B = scaled_BV.argmax(dim=-1)
        return tokens_B, torch.log_softmax(scaled_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
    keep_BV = truncation_mask(scaled_BV, top_k_B, top_p_B, min_p_B)
    probs_BV = torch.softmax(scaled_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    q_BV = exponential_noise(generators, V, logits_BV.device)
    random_B = (probs_BV / q_BV).argmax(dim=-1)
    greedy_B = scaled_BV.argmax(dim=-1)
    tokens_B = torch.where(temperature_B > 0, random_B, greedy_B)
    logprobs_B = torch.log_softmax(scaled_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
    return tokens_B, logprobs_B
