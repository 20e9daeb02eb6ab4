"""The static decode path through the Triton kernels the GPU runs (CPU, TRITON_INTERPRET=1 in a child
process, slow): with a bf16 model, NVFP4 KV and index keys, the padded pass equals the unpadded pass at
the same block-table width bit for bit, and garbage in the padded rows changes no real logit and no
page but the scratch page. (At another width the attention / indexer split plans differ: bf16 ulps.)"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.model.interpreted import run_module_interpreted, run_named


@pytest.mark.slow
def test_static_decode_through_triton_kernels_pads_harmlessly():
    result = run_module_interpreted("tests.rollout.test_runner_triton", ["padding"], timeout_s=1800)
    ok, msg = result["padding"]
    assert ok, msg


def check_padding(device: str) -> tuple[bool, str]:
    from rollout.engine import Request, SamplingParams
    from rollout.native import NativeEngine
    from tests.rollout.test_runner import build, prompts

    torch.set_num_threads(1)
    model = build(seed=3, kv_cache_dtype="nvfp4", index_cache_dtype="nvfp4").to(torch.bfloat16)
    eng = NativeEngine(model, max_pages=32, max_num_seqs=8, static_decode=True)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for p in prompts([17, 30, 5], 9):  # 3 decoding rows pad to the bucket of 4
        eng.add_request(Request(p, sp))
    while not all(s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    with torch.inference_mode():
        inputs, _, _ = eng._plan(eng.scheduler.schedule(), [], [])
        views = eng.runner.prepare(inputs)
        padded_RV = eng.runner.run(views, inputs).clone()
        W, scratch = eng.runner._width, eng.runner.scratch_page
        pages = [t.clone() for t in [*eng.cache.kv, *(i for i in eng.cache.index if i is not None)]]
        eng.runner.poison_padding(3, torch.Generator().manual_seed(0))
        poisoned_RV = eng.runner.run(views, inputs).clone()
        after = [t.clone() for t in [*eng.cache.kv, *(i for i in eng.cache.index if i is not None)]]
        unpadded_RV = model.forward_cached(
            torch.tensor(inputs.token_ids), torch.tensor(inputs.positions), torch.tensor(inputs.seq_idx),
            eng.cache, torch.tensor([t + [0] * (W - len(t)) for t in inputs.block_tables]),
            torch.tensor(inputs.seq_lens),
        )  # fmt: skip
    if not torch.equal(padded_RV, unpadded_RV):
        return False, f"padded != unpadded at width {W}: {float((padded_RV - unpadded_RV).abs().max())}"
    if not torch.equal(padded_RV, poisoned_RV):
        moved = float((padded_RV - poisoned_RV).abs().max())
        return False, f"garbage in padded rows moved real logits by {moved}"
    for before, now in zip(pages, after):
        keep = torch.arange(before.shape[0]) != scratch
        if not torch.equal(before[keep], now[keep]):
            return False, "garbage in padded rows changed a real page"
    return True, ""


if __name__ == "__main__":
    print(json.dumps(run_named({"padding": check_padding}, sys.argv[1:])))
