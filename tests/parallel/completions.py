"""Comparing a multi-rank engine replica's completions with a single engine's (DEP and DCP tests)."""

import torch

from rollout.engine import Completion

LOGPROB_ATOL = 1e-5  # fp32 engines: summation order only


def plain(cs: list[Completion]) -> list[tuple]:
    """Completions as picklable tuples (request id, sample index, tokens, logprobs, finish reason)."""
    return [(c.request_id, c.sample_index, c.token_ids, c.logprobs, c.finish_reason) for c in cs]


def assert_same(got: list[tuple], want: list[tuple], what: str) -> None:
    """Same requests, samples, tokens and finish reasons; logprobs within LOGPROB_ATOL."""
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert g[1:3] == w[1:3] and g[4] == w[4], f"{what}: {g[0]} tokens differ"
        torch.testing.assert_close(g[3], w[3], atol=LOGPROB_ATOL, rtol=0, msg=f"{what}: {g[0]} logprobs")
