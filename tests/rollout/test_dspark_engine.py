"""DSpark in the native engine (tiny model, CPU): greedy output equals the plain engine's token for
token whatever the batch composition and verify mode, log-probs are the target's, a batch whose
requests accept different lengths completes correctly, and the KV cache after rolling back
rejected drafts equals the cache of a run that never drafted them (fp32, bf16, NVFP4 caches).

Drafts come from two sources: a real (untrained) drafter, and `OracleProposer`, the real proposer
whose drafts are the plain engine's greedy continuation with a wrong token planted at a chosen
block position: this pins the accepted length of every request and step, so rollback and mixed
acceptance are exercised deterministically (the target pass, verification, rollback and the
drafter-context writes are the real code)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from model.kv_cache import gather_pages
from model.modeling import MiniMaxM3ForCausalLM
from rollout.dspark import Draft, Drafter, DSparkConfig, SpecConfig
from rollout.dspark.cache import target_hidden
from rollout.dspark.proposer import Proposer
from rollout.engine import Completion, Request, SamplingParams
from rollout.native import NativeEngine
from tests.rollout.tiny_models import build, prompts

BLOCK = 5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> MiniMaxM3ForCausalLM:
    return build()


def make_drafter(model, seed: int = 1) -> Drafter:
    cfg = DSparkConfig.for_target(model.config, block_size=BLOCK, num_layers=1, markov_rank=16)
    return Drafter(cfg).init_weights(std=0.05, seed=seed).bind(model).eval()


class OracleProposer(Proposer):
    """Drafts `reference[prompt]` (the plain greedy run's tokens) after the anchor, with a wrong
    token at block index wrong_at(seq) (>= BLOCK: none wrong)."""

    reference: dict[tuple[int, ...], list[int]]
    wrong_at: Callable
    garbage: int = 0  # picks the wrong token and the random tokens drafted after it

    def draft(self, seqs, block_tables_BP) -> Draft:
        V = self.drafter.config.vocab_size
        rows = []
        for s in seqs:
            ref = self.reference[s.prompt]
            start = s.num_computed + 1
            block = (ref[start : start + BLOCK] + [3] * BLOCK)[:BLOCK]
            j = self.wrong_at(s)
            if j < BLOCK:
                g = torch.Generator().manual_seed(1000 * self.garbage + start)
                block[j] = (block[j] + 1 + self.garbage) % V
                block[j + 1 :] = torch.randint(3, V, (BLOCK - j - 1,), generator=g).tolist()
            rows.append(block)
        tokens_BN = torch.tensor(rows, dtype=torch.long)
        is_sampling = any(s.rng is not None for s in seqs)
        probs = torch.nn.functional.one_hot(tokens_BN, V).float() if is_sampling else None
        return Draft(tokens_BN, probs, torch.ones(tokens_BN.shape))


def oracle_engine(model, reference, wrong_at, garbage: int = 0, **kw) -> NativeEngine:
    eng = NativeEngine(model, drafter=make_drafter(model), **kw)
    oracle = OracleProposer(eng.proposer.drafter, eng.proposer.spec, model, eng.cache)
    oracle.reference, oracle.wrong_at, oracle.garbage = reference, wrong_at, garbage
    eng.proposer = oracle
    return eng


def assert_same(a: list[Completion], b: list[Completion]) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
def test_greedy_with_dspark_equals_plain_engine_across_batch_compositions(model, mode):
    reqs = [Request(p, GREEDY, n=n) for p, n in zip(prompts([5, 17, 33, 12]), [1, 3, 1, 2])]
    kw = dict(max_pages=96, kv_dtype="fp32", index_dtype="fp32")
    plain = NativeEngine(model, **kw).generate(reqs)
    reference = {c.prompt_token_ids: list(c.prompt_token_ids) + c.token_ids for c in plain}
    spec = SpecConfig(mode=mode)
    for batch_kw in (dict(max_num_seqs=1), dict(max_batch_tokens=16), dict()):
        real = NativeEngine(model, drafter=make_drafter(model), spec=spec, **kw, **batch_kw)
        assert_same(real.generate(reqs), plain)
        assert real.stats().spec_steps > 0
        # Each request rejects at a different block position, changing every step.
        oracle = oracle_engine(model, reference, lambda s: (len(s.prompt) + len(s.output)) % (BLOCK + 2),
                               spec=spec, **kw, **batch_kw)  # fmt: skip
        out = oracle.generate(reqs)
        assert_same(out, plain)
        st = oracle.stats()
        assert st.spec_accepted > 0 and st.spec_accepted < st.spec_drafted
        assert st.tokens_generated == sum(len(c.token_ids) for c in out)


def test_mixed_acceptance_batch_completes_with_expected_accepted_lengths(model):
    ps = prompts([9, 21, 14, 30], seed=2)
    plain = NativeEngine(model, max_pages=64, kv_dtype="fp32", index_dtype="fp32")
    ref_out = plain.generate([Request(p, GREEDY) for p in ps])
    reference = {c.prompt_token_ids: list(c.prompt_token_ids) + c.token_ids for c in ref_out}
    wrong = {ps[0]: 0, ps[1]: BLOCK, ps[2]: 2, ps[3]: 4}  # reject all, accept all, keep 2, keep 4
    eng = oracle_engine(model, reference, lambda s: wrong[s.prompt], max_pages=64, kv_dtype="fp32",
                        index_dtype="fp32")  # fmt: skip
    out = eng.generate([Request(p, GREEDY) for p in ps])
    assert_same(out, ref_out)
    for c in out:
        j = wrong[c.prompt_token_ids]
        assert c.spec_steps > 0 and c.spec_drafted > 0
        # Every pass keeps min(j, k) drafts; only the last passes verify k < BLOCK (length cap).
        assert c.spec_accepted <= j * c.spec_steps
        if j == 0:
            assert c.spec_accepted == 0
        if j == BLOCK:
            assert c.spec_accepted == c.spec_drafted
        # The first token comes from prefill, at most one from a plain step once the cap reaches 0.
        assert len(c.token_ids) - 1 - (c.spec_accepted + c.spec_steps) in (0, 1)
    assert eng.scheduler.allocator.num_in_use == 0  # every page came back


def test_stop_token_inside_accepted_block_ends_the_sequence_there(model):
    p = prompts([11], seed=4)[0]
    ref = NativeEngine(model, max_pages=32, kv_dtype="fp32", index_dtype="fp32").generate(
        [Request(p, GREEDY)]
    )[0]
    stop = ref.token_ids[7]
    cut = ref.token_ids.index(stop)
    sp = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    reference = {p: list(p) + ref.token_ids}
    out = oracle_engine(model, reference, lambda s: BLOCK, max_pages=32, kv_dtype="fp32",
                        index_dtype="fp32").generate([Request(p, sp)])[0]  # fmt: skip
    assert (
        out.token_ids == ref.token_ids[: cut + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    )


def test_sampled_logprobs_with_dspark_are_the_targets(model):
    """Sampling (top-p, several samples sharing a prefix): each reported log-prob equals the
    training forward's log-prob of the sampled token at the sampling temperature."""
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True)
    reqs = [Request(p, sp, n=2, seed=3 * i) for i, p in enumerate(prompts([13, 26], seed=5))]
    eng = NativeEngine(model, max_pages=64, kv_dtype="fp32", index_dtype="fp32", drafter=make_drafter(model))
    for c in eng.generate(reqs):
        ids = torch.tensor(c.prompt_token_ids + tuple(c.token_ids))
        P = len(c.prompt_token_ids)
        with torch.no_grad():
            lp, _ = model.token_logprobs(ids[None, :-1], ids[None, 1:], temperature=0.8)
        assert len(c.token_ids) == 16
        torch.testing.assert_close(c.logprobs, lp[0, P - 1 :], atol=1e-5, rtol=0)


def _snapshot(eng: NativeEngine) -> tuple[int, list[torch.Tensor], torch.Tensor | None]:
    """(cached length, stored target K/V + index rows of every layer, drafter context rows)."""
    seq = eng.scheduler.running[0]
    n, table = seq.num_computed, torch.tensor(seq.block_table)
    rows = [gather_pages(kv.transpose(1, 2), table, n) for kv in eng.cache.kv]
    rows += [gather_pages(ix, table, n) for ix in eng.cache.index if ix is not None]
    ctx = gather_pages(eng.proposer.cache.pages, table, n) if eng.proposer is not None else None
    assert len(seq.block_table) <= n // eng.cache.page_size + 1  # pages past the next slot were freed
    return n, rows, ctx


def _run_steps(eng: NativeEngine, req: Request) -> dict[int, tuple]:
    eng.add_request(req)
    snaps = {}
    while eng.has_unfinished():
        eng.step()
        if eng.scheduler.running:
            n, rows, ctx = _snapshot(eng)
            snaps[n] = (rows, ctx)
    return snaps


@pytest.mark.parametrize("kv", ["fp32", "bf16", "nvfp4"])
def test_kv_after_rollback_equals_run_that_never_drafted_the_rejected_tokens(kv):
    """After every step, the kept prefix of the target KV and index keys equals (a) the plain
    engine's cache at the same length and (b) the cache of a run whose rejected drafts were other
    tokens. Bit for bit with NVFP4 pages; float pages are compared to ~1e-6 (fp32) / 1 ulp (bf16)
    because a position's float rounding depends on its pass mates (MoE experts group the pass's
    tokens, batched attention pads), not on rollback. The drafter context of the kept prefix equals
    a fresh full-sequence recomputation."""
    cfg_kv = "bf16" if kv == "fp32" else kv  # the config has no fp32 cache: the engine overrides it
    m = build(seed=3, kv_cache_dtype=cfg_kv, index_cache_dtype=cfg_kv)
    kw = dict(max_pages=16, kv_dtype=kv, index_dtype=kv)
    p = prompts([14], seed=6)[0]  # drafts straddle the 16-token page boundary
    req = Request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    plain_snaps = _run_steps(NativeEngine(m, **kw), req)
    ref = NativeEngine(m, **kw).generate([req])[0]
    reference = {p: list(p) + ref.token_ids}

    def wrong_at(s):  # rejections at varying block positions: steps roll back 0..BLOCK drafts
        return len(s.output) % (BLOCK + 1)

    eng = oracle_engine(m, reference, wrong_at, garbage=0, **kw)
    snaps = _run_steps(eng, req)
    other = _run_steps(oracle_engine(m, reference, wrong_at, garbage=1, **kw), req)
    assert eng.stats().spec_drafted > eng.stats().spec_accepted > 0
    assert len(snaps) >= 4 and set(snaps) == set(other) and set(snaps) <= set(plain_snaps)
    ids = torch.tensor(p + tuple(ref.token_ids))
    layer_ids = eng.proposer.drafter.config.target_layer_ids
    cap, _ = target_hidden(m, layer_ids, ids[None], kv_sim=kv != "fp32")
    expect_ctx = eng.proposer.drafter.context_kv(cap[0], torch.arange(len(ids)))
    for n, (rows, ctx) in snaps.items():
        for got, alt, want in zip(rows, other[n][0], plain_snaps[n][0]):
            if kv == "nvfp4":
                assert torch.equal(got, alt), f"rejected drafts left a trace in the kept KV at length {n}"
                assert torch.equal(got, want), f"stored KV differs from the plain run at length {n}"
            else:
                tol = dict(atol=1e-5, rtol=1e-5 if kv == "fp32" else 1.6e-2)
                torch.testing.assert_close(got, alt, **tol)
                torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(ctx, other[n][1], atol=1e-5, rtol=1e-5)
        # The fresh recomputation rounds K/V to bf16 from hidden states summed in another order than
        # the engine's step-by-step passes: a value on a bf16 rounding boundary can land one ulp
        # (0.4% relative) away and move the context by a few 1e-4 (3e-4 seen on some CPUs).
        ctx_tol = 1e-3 if kv == "bf16" else 1e-4
        torch.testing.assert_close(ctx, expect_ctx[:n], atol=ctx_tol, rtol=ctx_tol)
