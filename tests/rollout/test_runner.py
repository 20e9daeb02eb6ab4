"""Model runner on the tiny model (CPU): the static (padded, fixed-buffer) decode path that CUDA graphs
capture, sampling included, gives the unpadded engine's tokens and log-probs, and garbage in the padded
rows changes no real row (logits, tokens and log-probs bit for bit, every page but the scratch page)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine, sampler
from rollout.native.runner import batch_buckets
from tests.rollout.tiny_models import build, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> MiniMaxM3ForCausalLM:
    return build()


def mixed_requests(truncated: bool = True) -> list[Request]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=0.8, top_p=0.9 if truncated else 1.0, top_k=40 if truncated else 0,
                         max_tokens=10, ignore_eos=True)  # fmt: skip
    p = prompts([21, 9, 33], 4)
    return [Request(p[0], greedy), Request(p[1], hot, n=2, seed=7), Request(p[2], greedy)]


def test_batch_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(1000)[-1] == 256


@pytest.mark.parametrize(
    "kv, truncated", [("fp32", True), ("nvfp4", True), ("fp32", False), ("nvfp4", False)]
)
def test_static_decode_equals_the_unpadded_engine(kv, truncated):
    """Truncated rows re-sample the pass's logits eagerly; without truncation the pass samples."""
    m = build(seed=1) if kv == "fp32" else build(seed=3, kv_cache_dtype="nvfp4")
    kw = dict(max_pages=48, max_batch_tokens=40, max_num_seqs=8)
    if kv == "fp32":
        kw.update(kv_dtype="fp32", index_dtype="fp32")
    plain = NativeEngine(m, static_decode=False, **kw)
    static = NativeEngine(m, static_decode=True, **kw)
    a, b = plain.generate(mixed_requests(truncated)), static.generate(mixed_requests(truncated))
    assert static.runner.static_steps > 0 and plain.runner.static_steps == 0
    in_pass, steps = static.runner.sampled_in_pass, static.runner.static_steps
    if truncated:  # greedy-only steps after the truncated samples finish still sample in the pass
        assert 0 < in_pass < steps
    else:
        assert in_pass == steps
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    assert static.stats().pages_in_use == 0  # the scratch page is not the scheduler's


def test_garbage_in_padded_rows_changes_no_real_row(model):
    eng = NativeEngine(model, max_pages=32, kv_dtype="fp32", index_dtype="fp32", static_decode=True,
                       max_num_seqs=8)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for p in prompts([17, 30, 5], 9):  # 3 decoding sequences pad to the bucket of 4
        eng.add_request(Request(p, sp))
    while not all(s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    with torch.inference_mode():
        chunks = eng.scheduler.schedule()
        inputs, _, _ = eng._plan(chunks, [], [])
        assert inputs.is_decode and len(chunks) == 3
        views = eng.runner.prepare(inputs)
        first_RV = eng.runner.run(views, inputs).clone()
        scratch = eng.runner.scratch_page
        pages = [kv.clone() for kv in eng.cache.kv] + [ix.clone() for ix in eng.cache.index if ix is not None]
        eng.runner.poison_padding(3, torch.Generator().manual_seed(0))
        again_RV = eng.runner.run(views, inputs)
        after = [kv.clone() for kv in eng.cache.kv] + [ix.clone() for ix in eng.cache.index if ix is not None]
        unpadded_RV = eng.model.forward_cached(
            torch.tensor(inputs.token_ids),
            torch.tensor(inputs.positions),
            torch.tensor(inputs.seq_idx),
            eng.cache,
            torch.tensor([t + [0] * (4 - len(t)) for t in inputs.block_tables]),
            torch.tensor(inputs.seq_lens),
        )
    assert torch.equal(first_RV, again_RV)  # the real rows, bit for bit
    for before, now in zip(pages, after):
        keep = torch.ones(before.shape[0], dtype=torch.bool)
        keep[scratch] = False
        assert torch.equal(before[keep], now[keep])
    torch.testing.assert_close(first_RV, unpadded_RV, atol=1e-5, rtol=0)


def test_sampling_inside_the_static_pass_ignores_garbage_in_padded_rows(model):
    """The padded pass samples every row from its staged key: the real rows' tokens and log-probs do not
    move when the padded rows hold garbage (tokens, positions, temperatures, keys) and equal
    `sample_with_keys` of the real rows' logits with the same keys; the keys are drawn once, in `prepare`."""
    eng = NativeEngine(model, max_pages=32, kv_dtype="fp32", index_dtype="fp32", static_decode=True,
                       max_num_seqs=8)  # fmt: skip
    hot, greedy = (SamplingParams(temperature=t, max_tokens=8, ignore_eos=True) for t in (0.9, 0.0))
    for p, sp, seed in zip(prompts([17, 30, 5], 9), (hot, greedy, hot), (3, None, 4)):
        eng.add_request(Request(p, sp, seed=seed))
    while not all(s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    with torch.inference_mode():
        inputs, seqs, _ = eng._plan(eng.scheduler.schedule(), [], [])
        assert inputs.is_decode and len(seqs) == 3
        draws = [s.rng and s.rng.draws for s in seqs]
        views = eng.runner.prepare(inputs)
        assert [s.rng and s.rng.draws for s in seqs] == [d and d + 1 for d in draws]
        logits_RV = eng.runner.run(views, inputs).clone()
        assert "tokens_B" in views  # sampled inside the pass
        tokens_B, logprobs_B = (t.clone() for t in eng.runner.sample(logits_RV, views, inputs))
        _, _, clean_lp = (t.clone() for t in eng.runner.static_step(4))
        eng.runner.poison_padding(3, torch.Generator().manual_seed(0))
        again_RV = eng.runner.run(views, inputs)
        again_tok, again_lp = eng.runner.sample(again_RV, views, inputs)
        _, _, dirty_lp = eng.runner.static_step(4)
        assert [s.rng and s.rng.draws for s in seqs] == [d and d + 1 for d in draws]  # sample drew nothing
        ref_tok, ref_lp = sampler.sample_with_keys(logits_RV, views["temperature"], views["keys"])
    assert clean_lp[3] != dirty_lp[3]  # the garbage reached the padded row
    assert torch.equal(logits_RV, again_RV)
    assert torch.equal(tokens_B, again_tok) and torch.equal(logprobs_B, again_lp)
    assert torch.equal(tokens_B, ref_tok) and torch.equal(logprobs_B, ref_lp)


def test_preempted_samples_redraw_the_same_tokens_through_the_static_pass(model):
    """Keys drawn in `prepare` keep each sample's draw count what the eager engine's is: a tight page
    budget (preemptions, recompute) through the in-pass sampler gives a roomy eager engine's samples."""
    sp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    reqs = [
        Request(p, sp, seed=5 + i, n=2 if i == 1 else 1) for i, p in enumerate(prompts([20, 30, 11, 25], 4))
    ]
    kw = dict(kv_dtype="fp32", index_dtype="fp32", max_num_seqs=8)
    reference = NativeEngine(model, max_pages=64, **kw).generate(reqs)
    eng = NativeEngine(model, max_pages=5, max_batch_tokens=48, static_decode=True, **kw)
    tight = eng.generate(reqs)
    assert eng.stats().preemptions > 0 and eng.runner.sampled_in_pass > 0
    assert [c.token_ids for c in tight] == [c.token_ids for c in reference]
    for x, y in zip(tight, reference):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_cuda_graphs_on_a_cpu_model_is_refused(model):
    with pytest.raises(ValueError, match="CUDA"):
        NativeEngine(model, max_pages=8, cuda_graphs=True)


class _HostSyncDetector(TorchDispatchMode):
    """Records every op that needs device values on the host (a sync on CUDA, a capture breaker):
    scalar reads, data-dependent output sizes, boolean-mask indexing."""

    SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(op in name for op in self.SYNC_OPS):
            self.found.append(name)
        if "index" in name and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for a in args
            if isinstance(a, list | tuple)
            for t in a
        ):
            self.found.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kv", ["fp32", "nvfp4"])
def test_static_decode_pass_reads_no_device_value_on_the_host(kv):
    """The padded pass CUDA graphs capture, run on the CPU: no op that would sync (or break capture)."""
    m = build(seed=2) if kv == "fp32" else build(seed=2, kv_cache_dtype="nvfp4")
    extra = dict(kv_dtype="fp32", index_dtype="fp32") if kv == "fp32" else {}
    eng = NativeEngine(m, max_pages=16, static_decode=True, max_num_seqs=4, **extra)
    eng.generate([Request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts([20, 7], 5)])
    detector, control = _HostSyncDetector(), _HostSyncDetector()
    with torch.inference_mode(), detector:
        eng.runner.static_step(4)  # the forward and the sampling a graph captures
    assert detector.found == []
    v, W = eng.runner._static_views, eng.runner._width
    with torch.inference_mode(), control:  # the same pass outside static_shapes: the detector sees syncs
        eng.model.forward_cached(v["ids"][:4], v["pos"][:4], v["seq"][:4], eng.cache,
                                 v["table"][: 4 * W].view(4, W), v["lens"][:4])  # fmt: skip
    assert control.found


def test_cpu_engines_default_to_plain_eager_passes_and_a_prebuilt_cache_refuses_static_decode(model):
    eng = NativeEngine(model, max_pages=8)
    assert not eng.runner.static_decode and not eng.runner.cuda_graphs
    assert eng.cache.num_pages == 8  # no scratch page unless the static path is on
    assert NativeEngine(model, max_pages=8, static_decode=True).cache.num_pages == 9
    with pytest.raises(ValueError, match="static_decode"):
        NativeEngine(model, max_pages=8, static_decode=True, cache=model.new_kv_cache(9))


# ~80 s of Inductor compiles on a 2-core CI machine: opt-in (`make test-slow`); on CUDA the compiled
# path is checked by tests/rollout/test_cuda_graphs.py::test_compiled_graph_replay_equals_eager_runner_fp32.
@pytest.mark.slow
def test_compiled_static_decode_equals_the_unpadded_engine_on_the_cpu(model):
    """torch.compile of the padded pass (the path compiled before capture on CUDA) keeps the engine's
    numbers: same tokens, fp32 log-probs within 1e-4 (Inductor reorders sums; 2e-5 measured)."""
    kw = dict(max_pages=64, max_batch_tokens=64, max_num_seqs=8)
    compiled = NativeEngine(model, compile_decode=True, **kw)
    eager = NativeEngine(model, **kw)
    assert compiled.runner.static_decode and not eager.runner.static_decode
    reqs = mixed_requests()
    out_c, out_e = compiled.generate(reqs), eager.generate(reqs)
    assert compiled.runner.compile_error is None, compiled.runner.compile_error
    assert compiled.runner.compile_decode and compiled.runner.static_steps > 0
    assert [c.token_ids for c in out_c] == [c.token_ids for c in out_e]
    for a, b in zip(out_c, out_e):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
