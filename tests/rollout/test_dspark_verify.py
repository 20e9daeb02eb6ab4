"""DSpark verification is lossless: the emitted tokens are distributed as the target's (a chi-square
test over a 4-token vocabulary that rejects a deliberately biased verifier), greedy verification
keeps exactly the argmax-matching prefix, and the verify scheduler picks sensible prefixes."""

from __future__ import annotations

import pytest
import torch

from rollout.dspark import verify as verify_mod
from rollout.dspark.schedule import SpecConfig, choose_num_verify, fit_step_cost
from rollout.dspark.verify import verify
from rollout.native.sampler import CounterRNG

V, K, ROWS = 4, 2, 30_000
ALPHA = 1e-3  # significance: the real verifier fails by chance with probability 0.001 (fixed seed here)


def _chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df > stat): the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2.0)))


def _problem(seed: int = 0):
    """Target p1, p2(. | x1) and p3(. | x2) and draft q1, q2, deliberately different from p."""
    g = torch.Generator().manual_seed(seed)
    p1_logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    p2_logits = torch.randn(V, V, generator=g) * 1.5  # row = previous token
    p3_logits = torch.randn(V, V, generator=g) * 1.5
    q1 = torch.tensor([0.1, 0.5, 0.3, 0.1])
    q2 = torch.tensor([0.4, 0.1, 0.1, 0.4])
    return p1_logits, p2_logits, p3_logits, q1, q2


def _run_verifier():
    p1_logits, p2_logits, p3_logits, q1, q2 = _problem()
    g = torch.Generator().manual_seed(1)
    d1 = torch.multinomial(q1, ROWS, replacement=True, generator=g)
    d2 = torch.multinomial(q2, ROWS, replacement=True, generator=g)
    logits = torch.stack([p1_logits.expand(ROWS, V), p2_logits[d1], p3_logits[d2]], dim=1)
    probs = torch.stack([q1.expand(ROWS, V), q2.expand(ROWS, V)], dim=1)
    gens = [CounterRNG(100 + i) for i in range(ROWS)]
    res = verify(logits, torch.stack([d1, d2], 1), probs, torch.full((ROWS,), K), torch.ones(ROWS),
                 gens)  # fmt: skip
    return res, p1_logits, p2_logits


def _chi2_first_two_tokens(res, p1_logits, p2_logits) -> tuple[float, int]:
    """Chi-square of the first emitted token against p1 plus, where a second token was emitted,
    of the second against p2(. | first)."""
    x1 = res.tokens_BK1[:, 0]
    stat, df = 0.0, 0
    expected = torch.softmax(p1_logits, -1) * ROWS
    stat += float(((torch.bincount(x1, minlength=V) - expected) ** 2 / expected).sum())
    df += V - 1
    has2 = res.num_accepted_B >= 1
    for a in range(V):
        sel = has2 & (x1 == a)
        n = int(sel.sum())
        if n < 200:
            continue
        expected = torch.softmax(p2_logits[a], -1) * n
        stat += float(
            ((torch.bincount(res.tokens_BK1[sel, 1], minlength=V) - expected) ** 2 / expected).sum()
        )
        df += V - 1
    return stat, df


def test_verifier_output_distribution_equals_target_chi_square():
    res, p1, p2 = _run_verifier()
    stat, df = _chi2_first_two_tokens(res, p1, p2)
    assert df >= 9, "too few second tokens for the test to mean anything"
    assert _chi2_sf(stat, df) > ALPHA, f"chi2={stat:.1f} df={df}"
    # It speculated: accepted lengths vary between 0 and K.
    assert set(res.num_accepted_B.unique().tolist()) == {0, 1, 2}


@pytest.mark.parametrize("bias", ["resample_from_target", "accept_all_likely"])
def test_biased_verifier_fails_the_same_chi_square(monkeypatch, bias):
    if bias == "resample_from_target":  # forgets to subtract the draft: classic bug
        monkeypatch.setattr(verify_mod, "residual_distribution", lambda p, q: p)
    else:  # uses the residual but also keeps drafts the target finds unlikely half of the time
        real = verify_mod.residual_distribution

        def biased(p, q):
            r = real(p, q)
            return 0.5 * r + 0.5 * q / q.sum(-1, keepdim=True).clamp(min=1e-30)

        monkeypatch.setattr(verify_mod, "residual_distribution", biased)
    res, p1, p2 = _run_verifier()
    stat, df = _chi2_first_two_tokens(res, p1, p2)
    assert _chi2_sf(stat, df) < ALPHA, f"the biased verifier passed: chi2={stat:.1f} df={df}"


def test_greedy_verify_keeps_argmax_prefix_and_emits_target_argmax():
    B = 4
    logits = torch.randn(B, K + 2, V, generator=torch.Generator().manual_seed(0))
    am = logits.argmax(-1)
    drafts = am[:, : K + 1].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # row 1 rejects the first draft
    drafts[2, 2] = (drafts[2, 2] + 1) % V  # row 2 rejects the third
    num_draft = torch.tensor([3, 3, 3, 1])  # row 3 verifies one draft only
    res = verify(logits, drafts, None, num_draft, torch.zeros(B), [None] * B)
    assert res.num_accepted_B.tolist() == [3, 0, 2, 1]
    for b, m in enumerate(res.num_accepted_B.tolist()):
        assert res.tokens_BK1[b, : m + 1].tolist() == am[b, : m + 1].tolist()
        lp = torch.log_softmax(logits[b], -1).gather(-1, res.tokens_BK1[b, :, None])[:, 0]
        torch.testing.assert_close(res.logprobs_BK1[b, : m + 1], lp[: m + 1])


def test_verify_with_truncation_never_emits_tokens_outside_top_k():
    B = 2000
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0]).expand(B, 2, V).clone()
    q = torch.full((B, 1, V), 0.25)
    drafts = torch.multinomial(q[:, 0], 1, replacement=True, generator=torch.Generator().manual_seed(0))
    gens = [CounterRNG(i) for i in range(B)]
    res = verify(logits, drafts, q, torch.ones(B, dtype=torch.long), torch.ones(B), gens,
                 top_k_B=torch.full((B,), 2))  # fmt: skip
    emitted = torch.cat([res.tokens_BK1[b, : m + 1] for b, m in enumerate(res.num_accepted_B.tolist())])
    assert int(emitted.max()) <= 1


def test_choose_num_verify_free_tokens_verify_everything_costly_tokens_verify_likely_ones():
    survival = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.3, 0.1, 0.0, 0.0]])
    caps = torch.tensor([4, 3])
    assert choose_num_verify(survival, caps, fixed_s=1.0, per_token_s=0.0, extra_value=2) == [4, 2]
    # A draft is worth verifying iff its survival exceeds (tokens per second so far) x per-token cost.
    assert choose_num_verify(survival, caps, fixed_s=1.0, per_token_s=0.1, extra_value=2) == [2, 0]
    assert choose_num_verify(survival, torch.tensor([1, 0]), 1.0, 0.0, 2) == [1, 0]


def test_fit_step_cost_recovers_a_line_and_spec_config_validates():
    cost = fit_step_cost([1, 5, 10, 40], [0.011, 0.015, 0.020, 0.050])
    assert cost.base_s == pytest.approx(0.010, abs=1e-6) and cost.per_token_s == pytest.approx(
        0.001, abs=1e-6
    )
    with pytest.raises(ValueError, match="mode"):
        SpecConfig(mode="adaptive")
    with pytest.raises(ValueError, match="num_verify"):
        SpecConfig(num_verify=0)
