"""Sampler: truncation against an explicit per-row reference, the log-prob convention, seeded
reproducibility independent of the batch, and sampled frequencies against the target law."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.engine import Request, SamplingParams
from rollout.native import sampler


def kept_ref(logits_V: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The documented rule, one row, in float64 with Python loops."""
    probs = torch.softmax(logits_V.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda v: (-probs[v], v))
    k = top_k if top_k > 0 else len(order)
    head = order[:k]
    z = sum(probs[v] for v in head)
    kept, mass = [], 0.0
    for v in head:
        if top_p < 1 and mass >= top_p:
            break
        kept.append(v)
        mass += probs[v] / z
    pmax = probs[order[0]]
    return {v for v in kept if probs[v] >= min_p * pmax} | {order[0]}


def gens(seeds):
    return [None if s is None else sampler.CounterRNG(s) for s in seeds]


def test_truncation_mask_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 24, 50
    logits = torch.randn(B, V, generator=g) * 3
    top_k = torch.randint(0, 12, (B,), generator=g)
    top_p = torch.rand(B, generator=g) * 0.9 + 0.1
    top_p[::5] = 1.0
    min_p = torch.rand(B, generator=g) * 0.2
    min_p[::3] = 0.0
    keep = sampler.truncation_mask(logits, top_k, top_p, min_p)
    for b in range(B):
        ref = kept_ref(logits[b], int(top_k[b]), float(top_p[b]), float(min_p[b]))
        assert set(keep[b].nonzero()[:, 0].tolist()) == ref, b


def test_truncation_off_keeps_every_token_even_when_cumsum_rounds_to_one():
    logits = torch.tensor([[30.0] + [-30.0] * 99])  # tail mass underflows the fp32 cumsum
    keep = sampler.truncation_mask(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert keep.all()
    assert sampler.truncation_mask(logits).all()


def test_greedy_rows_take_argmax_and_report_unscaled_logprob():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    tok, lp = sampler.sample(logits, torch.zeros(3), [None] * 3)
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])
    assert lp.dtype == torch.float32


def test_logprob_is_temperature_scaled_and_before_truncation():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 2
    temp = torch.tensor([0.5, 0.7, 1.0, 1.3])
    tok, lp = sampler.sample(logits, temp, gens([1, 2, 3, 4]), top_k_B=torch.tensor([3, 5, 2, 4]))
    ref = torch.log_softmax(logits / temp[:, None], -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    # The sampled token lies in its row's top-k.
    for b, k in enumerate([3, 5, 2, 4]):
        assert tok[b] in logits[b].topk(k).indices


def test_same_seed_same_draws_whatever_the_other_rows():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))
    temp = torch.ones(5)
    alone = [sampler.sample(logits[b : b + 1], temp[:1], gens([7]))[0].item() for b in range(5)]
    batched, _ = sampler.sample(logits, temp, gens([7, 7, 7, 7, 7]))
    assert batched.tolist() == alone
    # Greedy neighbours consume no randomness and do not shift a sampled row's draws.
    mixed, _ = sampler.sample(logits[:3], torch.tensor([0.0, 1.0, 0.0]), gens([None, 7, None]))
    assert mixed[1].item() == alone[1]
    other, _ = sampler.sample(logits, temp, gens([8, 8, 8, 8, 8]))
    assert other.tolist() != alone


def test_sampled_frequencies_follow_truncated_distribution():
    V, N = 6, 6000
    logits_V = torch.tensor([1.0, 0.5, 0.2, -0.3, -1.0, -2.0])
    temp = 0.8
    top_p = 0.8
    scaled = logits_V / temp
    keep = kept_ref(scaled, 0, top_p, 0.0)
    target = torch.zeros(V)
    target[list(keep)] = torch.softmax(scaled, -1)[list(keep)]
    target /= target.sum()
    gen = sampler.CounterRNG(11)  # one stream shared by every row: each row takes its next draw
    logits = logits_V.expand(N, V).contiguous()
    tok, _ = sampler.sample(logits, torch.full((N,), temp), [gen] * N, top_p_B=torch.full((N,), top_p))
    freq = torch.bincount(tok, minlength=V).double() / N
    for v in range(V):
        if v not in keep:
            assert freq[v] == 0
        else:
            sigma = math.sqrt(target[v] * (1 - target[v]) / N)
            assert abs(freq[v] - target[v]) < 5 * sigma, (v, freq[v], target[v])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_invalid_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        Request(())
    with pytest.raises(ValueError, match="n must"):
        Request((1, 2), n=0)
    with pytest.raises(ValueError, match="seed"):
        Request((1, 2), seed=-1)
    with pytest.raises(ValueError, match="ints"):
        Request((1.5, 2))


def test_counter_noise_is_uniform_independent_and_reproducible():
    """The counter-based draws: uniform on (0, 1) (quantiles, mean), uncorrelated across rows, across
    elements and across a row's consecutive draws, the same for the same (seed, draw count) whatever
    the batch, and Exp(1) after -log (mean and variance 1)."""
    rngs = [sampler.CounterRNG(s) for s in range(64)]
    u = sampler.uniform_noise(rngs, 4096, torch.device("cpu"))
    assert u.shape == (64, 4096) and float(u.min()) > 0 and float(u.max()) < 1
    assert all(r.draws == 1 for r in rngs)
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    q = torch.quantile(u.flatten()[:100_000].double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    assert torch.allclose(q, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), atol=0.01)
    corr = torch.corrcoef(u.double())  # rows
    off = corr[~torch.eye(64, dtype=torch.bool)]
    assert float(off.abs().max()) < 6 / math.sqrt(4096)
    lag = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]).double())[0, 1]
    assert abs(float(lag)) < 6 / math.sqrt(n)
    again = sampler.uniform_noise(rngs, 4096, torch.device("cpu"))  # the next draw: new numbers
    assert abs(
        float(torch.corrcoef(torch.stack([u.flatten(), again.flatten()]).double())[0, 1])
    ) < 6 / math.sqrt(n)
    fresh = [sampler.CounterRNG(s) for s in (5, 3)]
    alone = sampler.uniform_noise([None, fresh[0], None, fresh[1]], 4096, torch.device("cpu"))
    assert torch.equal(alone[1], u[5]) and torch.equal(alone[3], u[3]) and float(alone[0].abs().max()) == 0
    e = sampler.exponential_noise(
        [sampler.CounterRNG(s) for s in range(16)], 8192, torch.device("cpu")
    ).double()
    assert abs(float(e.mean()) - 1) < 0.02 and abs(float(e.var()) - 1) < 0.05


@pytest.mark.parametrize("truncated", [False, True])
def test_sample_with_keys_equals_sample_bit_for_bit_and_greedy_rows_draw_nothing(truncated):
    """The keyed sampler (what a CUDA graph captures) with each row's `next_key()` gives `sample`'s
    tokens and log-probs bit for bit on mixed greedy / random rows; greedy rows consume no draw and
    ignore their key; an all-greedy batch without keys equals the keyed path."""
    g = torch.Generator().manual_seed(4)
    B, V = 12, 300
    logits = torch.randn(B, V, generator=g) * 2
    temp = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.9, 0.0, 0.5, 1.1, 0.0, 0.8, 1.0])
    seeds = [None if t == 0 else 100 + b for b, t in enumerate(temp.tolist())]
    trunc = {}
    if truncated:
        trunc = dict(
            top_k_B=torch.randint(0, 20, (B,), generator=g),
            top_p_B=torch.rand(B, generator=g) * 0.5 + 0.5,
            min_p_B=torch.rand(B, generator=g) * 0.1,
        )
    rngs = gens(seeds)
    tok, lp = sampler.sample(logits, temp, rngs, **trunc)
    assert [None if r is None else r.draws for r in rngs] == [None if s is None else 1 for s in seeds]
    keys = torch.tensor([0 if s is None else sampler.CounterRNG(s).next_key() for s in seeds])
    tok_k, lp_k = sampler.sample_with_keys(logits, temp, keys, **trunc)
    assert torch.equal(tok, tok_k) and torch.equal(lp, lp_k)
    garbage = torch.where(temp > 0, keys, torch.randint(-(2**62), 2**62, (B,), generator=g))
    tok_g, lp_g = sampler.sample_with_keys(logits, temp, garbage, **trunc)
    assert torch.equal(tok, tok_g) and torch.equal(lp, lp_g)
    # The random rows are really random: other keys move some of them, never a greedy row.
    tok_o, _ = sampler.sample_with_keys(logits, temp, keys + 1, **trunc)
    assert (tok_o != tok)[temp > 0].any() and torch.equal(tok_o[temp == 0], tok[temp == 0])
    zeros = torch.zeros(B)
    greedy, greedy_lp = sampler.sample(logits, zeros, [None] * B, **trunc)
    keyed, keyed_lp = sampler.sample_with_keys(logits, zeros, garbage, **trunc)
    assert torch.equal(greedy, keyed) and torch.equal(greedy_lp, keyed_lp)


def test_banned_ids_are_never_drawn_and_keep_the_full_vocabulary_logprob():
    """Banned ids (a vision model's image tokens) equal sampling from logits with those ids at -inf,
    bit for bit, while the reported log-prob is the unbanned one (the truncation convention)."""
    g = torch.Generator().manual_seed(5)
    B, V = 8, 64
    logits = torch.randn(B, V, generator=g)
    banned = torch.tensor([3, 10, 11, 40])
    logits[:, banned] += 6.0  # most of the mass on banned ids
    temp = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.2, 1.0, 0.6, 0.0])
    seeds = [None if t == 0 else 7 + b for b, t in enumerate(temp.tolist())]
    tok, lp = sampler.sample(logits, temp, gens(seeds), top_p_B=torch.full((B,), 0.9), banned_ids=banned)
    allowed = logits.index_fill(-1, banned, float("-inf"))
    ref_tok, _ = sampler.sample(allowed, temp, gens(seeds), top_p_B=torch.full((B,), 0.9))
    ref_lp = torch.log_softmax(sampler.temperature_scaled(logits, temp), -1).gather(-1, ref_tok[:, None])[
        :, 0
    ]
    assert torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)
    assert not set(tok.tolist()) & set(banned.tolist())


def test_draw_keys_for_many_rows_equal_each_rngs_next_key():
    """The vectorized draw (many distinct rngs) gives `next_key`'s bits and advances every counter once;
    a shared rng still gives each of its rows the next draw."""
    g = torch.Generator().manual_seed(5)
    seeds = [int(s) for s in torch.randint(-(2**63), 2**63 - 1, (40,), generator=g)]
    seeds += [0, 2**63 - 1, -(2**63)]
    rngs = [sampler.CounterRNG(s) for s in seeds]
    twins = [sampler.CounterRNG(s) for s in seeds]
    for r, t, k in zip(rngs, twins, range(len(seeds))):
        r.draws = t.draws = k * 977  # counters far apart
    rows = [None, *rngs[:20], None, *rngs[20:]]
    for _ in range(3):
        want = [0 if r is None else twins[rngs.index(r)].next_key() for r in rows]
        assert sampler.draw_keys(rows) == want
    assert [r.draws for r in rngs] == [t.draws for t in twins]
    twin = sampler.CounterRNG(seeds[0])
    twin.draws = rngs[0].draws
    assert sampler.draw_keys([rngs[0]] * 20) == [twin.next_key() for _ in range(20)]
