"""Lossless verification of drafted blocks: speculative sampling (docs/FACTS.md, DSpark section).

What: `verify` takes per request the target's logits at the anchor and at each of its k drafts, the
drafted tokens and the distributions q they were drawn from, and keeps a prefix: sampling rows accept
x_j with probability min(1, p_j(x_j) / q_j(x_j)), draw from norm(max(0, p_j - q_j)) at the first
rejection and a bonus token from p_k if all pass, p being exactly the plain sampler's truncated
distribution (rollout/native/sampler.py); greedy rows accept while the draft equals the target's
argmax (first index on ties). Requests verify different numbers of drafts (`num_draft_B`).

Invariants: emitted tokens are distributed exactly as the non-speculative engine's (greedy: equal
token for token); returned log-probs are the target's, by rollout/engine.py's convention; no host
sync (the caller syncs once on `num_accepted_B`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.native import sampler

# Legend: B requests, K drafted tokens verified at most (rows K + 1), V vocab.


@dataclass
class VerifyResult:
    num_accepted_B: torch.Tensor  # int64 m in [0, num_draft]: drafts kept; m + 1 tokens are emitted
    tokens_BK1: torch.Tensor  # int64, row b's emitted tokens are tokens[b, : m + 1]
    logprobs_BK1: torch.Tensor  # fp32, target log-probs of those tokens


def residual_distribution(p_BV: torch.Tensor, q_BV: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; rows where p <= q everywhere (only possible when p == q, where
    rejection has probability 0) fall back to p."""
    r_BV = (p_BV - q_BV).clamp(min=0)
    mass_B1 = r_BV.sum(-1, keepdim=True)
    return torch.where(mass_B1 > 0, r_BV / mass_B1.clamp(min=1e-30), p_BV)


def verify(
    target_logits_BK1V: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    num_draft_B: torch.Tensor,
    temperature_B: torch.Tensor,
    rngs: list[sampler.CounterRNG | None],
    top_k_B: torch.Tensor | None = None,
    top_p_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts (rule in the module docstring). Row b verifies its
    first num_draft_B[b] drafts; rows of the logits past that are ignored. Rows with temperature
    0 must have rng None; draft_probs may be None only if every row is greedy."""
    B, K1, V = target_logits_BK1V.shape
    K = K1 - 1
    if draft_tokens_BK.shape != (B, K) or num_draft_B.shape != (B,) or len(rngs) != B:
        got = f"{tuple(draft_tokens_BK.shape)}, {tuple(num_draft_B.shape)}, {len(rngs)}"
        raise ValueError(f"need draft_tokens [{B}, {K}], num_draft [{B}] and {B} rngs, got {got}")
    is_sampling = any(g is not None for g in rngs)
    if is_sampling and (draft_probs_BKV is None or draft_probs_BKV.shape[:2] != (B, K)):
        raise ValueError("sampling rows need draft_probs [B, K, V]: the distributions the drafts came from")
    dev = target_logits_BK1V.device

    def rows(x_B: torch.Tensor | None) -> torch.Tensor | None:  # per-request value -> per-row value
        return None if x_B is None else x_B.repeat_interleave(K1)

    scaled_RV = sampler.temperature_scaled(target_logits_BK1V.reshape(B * K1, V), rows(temperature_B))
    keep_RV = sampler.truncation_mask(scaled_RV, rows(top_k_B), rows(top_p_B), rows(min_p_B))
    p_BK1V = torch.softmax(scaled_RV.masked_fill(~keep_RV, float("-inf")), dim=-1).view(B, K1, V)
    logp_BK1V = torch.log_softmax(scaled_RV, dim=-1).view(B, K1, V)
    argmax_BK1 = scaled_RV.argmax(-1).view(B, K1)

    j_K = torch.arange(K, device=dev)
    is_greedy_B1 = (temperature_B <= 0)[:, None]
    ok_BK = draft_tokens_BK == argmax_BK1[:, :K]
    if is_sampling:
        p_draft_BK = p_BK1V[:, :K].gather(-1, draft_tokens_BK[..., None])[..., 0]
        q_draft_BK = draft_probs_BKV[:, :K].gather(-1, draft_tokens_BK[..., None])[..., 0].float()
        u_BK = sampler.uniform_noise(rngs, K, dev)
        ok_BK = torch.where(is_greedy_B1, ok_BK, u_BK * q_draft_BK < p_draft_BK)
    ok_BK &= j_K[None, :] < num_draft_B[:, None]
    m_B = ok_BK.long().cumprod(dim=-1).sum(dim=-1)

    # The token after the accepted prefix: residual after a rejection, p itself for the bonus.
    b_B = torch.arange(B, device=dev)
    new_B = argmax_BK1[b_B, m_B]
    if is_sampling:
        p_BV = p_BK1V[b_B, m_B]
        rejected_B1 = (m_B < num_draft_B)[:, None]
        q_BV = draft_probs_BKV[b_B, m_B.clamp(max=K - 1)].float() if K > 0 else torch.zeros_like(p_BV)
        r_BV = residual_distribution(p_BV, torch.where(rejected_B1, q_BV, torch.zeros_like(q_BV)))
        noise_BV = sampler.exponential_noise(rngs, V, dev)
        new_B = torch.where(is_greedy_B1[:, 0], new_B, (r_BV / noise_BV).argmax(-1))

    tokens_BK1 = torch.cat([draft_tokens_BK, draft_tokens_BK.new_zeros(B, 1)], dim=1)
    tokens_BK1[b_B, m_B] = new_B
    logprobs_BK1 = logp_BK1V.gather(-1, tokens_BK1[..., None])[..., 0]
    return VerifyResult(m_B, tokens_BK1, logprobs_BK1)
