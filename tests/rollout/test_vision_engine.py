"""Native engine with image prompts (tiny-vl, CPU, fp32): log-probs equal the learner's forward with
the same images and a nonzero adapter, also when chunked prefill splits an image's placeholder span;
prompt pages are shared only within a request, never between equal ids with other images; image
ids are never sampled; features are cached per image and recomputed when a projector adapter
changes; bad image requests fail before any compute."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora, lora_state_dict
from model.modeling import MiniMaxM3ForCausalLM
from model.vision import ImageInputError, apply_projector_lora, placeholder_ids, preprocess_image
from rollout.engine import Completion, Request, SamplingParams
from rollout.native import NativeEngine


def with_random_adapter(m: MiniMaxM3ForCausalLM, seed: int, projector: bool = False) -> MiniMaxM3ForCausalLM:
    apply_lora(m, LoRAConfig(r=2, alpha=4.0), seed=seed)
    if projector:
        apply_projector_lora(m, r=2, alpha=4.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:  # B = 0 at init: make the adapter change the outputs
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m.eval()


@pytest.fixture(scope="module")
def model() -> MiniMaxM3ForCausalLM:
    m = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny-vl")).init_weights(std=0.1, seed=0)
    return with_random_adapter(m, seed=1)


def image(w: int, h: int, seed: int, vcfg):
    pixels = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return preprocess_image(buf.getvalue(), vcfg)


@pytest.fixture(scope="module")
def images(model):
    vcfg = model.vision.config
    return [image(32, 24, 1, vcfg), image(40, 40, 2, vcfg), image(24, 32, 3, vcfg)]  # 12, 25, 12 tokens


def prompt(imgs, vcfg, text=(40, 50, 60)) -> tuple[int, ...]:
    ids = [1, *text]
    for im in imgs:
        ids += placeholder_ids(im.num_tokens, vcfg) + list(text)
    return tuple(ids)


def engine(m, **kw) -> NativeEngine:
    kw.setdefault("max_pages", 64)
    return NativeEngine(m, kv_dtype="fp32", index_dtype="fp32", **kw)


def learner_logprobs(m, c: Completion, imgs, temperature: float = 1.0) -> torch.Tensor:
    ids_S = torch.tensor(c.prompt_token_ids + tuple(c.token_ids))
    with torch.no_grad():
        lp_1S, _ = m.token_logprobs(ids_S[None, :-1], ids_S[None, 1:], images=imgs, temperature=temperature)
    return lp_1S[0, len(c.prompt_token_ids) - 1 :]


def assert_matches_learner(m, out: list[Completion], imgs) -> None:
    for c in out:
        torch.testing.assert_close(c.logprobs, learner_logprobs(m, c, imgs), atol=1e-5, rtol=0)


SP = SamplingParams(max_tokens=8, ignore_eos=True)


def test_one_image_prompt_logprobs_equal_learner_with_lora(model, images):
    imgs = images[:1]
    out = engine(model).generate([Request(prompt(imgs, model.vision.config), SP, seed=0, images=imgs)])
    assert len(out[0].token_ids) == 8
    assert_matches_learner(model, out, imgs)


def test_two_images_with_prefill_chunks_ending_inside_spans_equal_learner(model, images):
    imgs = images[:2]
    ids = prompt(imgs, model.vision.config)
    spans = [i for i, t in enumerate(ids) if t == model.vision.config.image_token_id]
    # 7-token chunks end at positions 7, 14, 21, ...: inside both spans (4..15 and 20..44).
    assert any(spans[0] < k < spans[11] for k in range(7, len(ids), 7))
    assert any(spans[12] < k < spans[-1] for k in range(7, len(ids), 7))
    out = engine(model, max_batch_tokens=7).generate([Request(ids, SP, n=2, seed=3, images=imgs)])
    assert_matches_learner(model, out, imgs)
    whole = engine(model, max_batch_tokens=512).generate([Request(ids, SP, n=2, seed=3, images=imgs)])
    assert [c.token_ids for c in whole] == [c.token_ids for c in out]


def test_equal_ids_with_other_images_never_share_pages_and_match_their_own_runs(model, images):
    vcfg = model.vision.config
    a, c = images[0], images[2]  # same token count: identical prompt ids, different pixels
    ids = prompt([a], vcfg)
    assert ids == prompt([c], vcfg)
    reqs = [Request(ids, SP, seed=5, images=(a,)), Request(ids, SP, seed=5, images=(c,))]
    eng = engine(model)
    together = eng.generate(reqs)
    assert eng.stats().shared_prefix_pages == 0
    assert (together[0].logprobs - together[1].logprobs).abs().max() > 1e-3
    for req, got, im in zip(reqs, together, (a, c)):
        alone = engine(model).generate([req])[0]
        assert got.token_ids == alone.token_ids
        # fp32 log-probs near -6 differ by ~2 ulps (1.4e-6) between batch compositions on some CPUs
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        assert_matches_learner(model, [got], [im])


def test_group_samples_share_image_prompt_pages_and_equal_independent_requests(model, images):
    imgs = images[:2]
    ids = prompt(imgs, model.vision.config)
    eng = engine(model)
    group = eng.generate([Request(ids, SP, n=3, seed=10, images=imgs)])
    assert eng.stats().shared_prefix_pages > 0
    single = engine(model).generate([Request(ids, SP, seed=10 + i, images=imgs) for i in range(3)])
    assert [c.token_ids for c in group] == [c.token_ids for c in single]
    for g, s in zip(group, single):
        torch.testing.assert_close(g.logprobs, s.logprobs, atol=1e-5, rtol=0)


def test_preemption_with_image_prompts_recomputes_the_same_output(model, images):
    vcfg = model.vision.config
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    reqs = [
        Request(prompt(images[:2], vcfg), sp, n=2, seed=1, images=tuple(images[:2])),
        Request(prompt(images[2:], vcfg), sp, seed=2, images=tuple(images[2:])),
    ]
    reference = engine(model).generate(reqs)
    eng = engine(model, max_pages=6, max_batch_tokens=32, image_cache_rows=0)  # recompute = re-encode
    tight = eng.generate(reqs)
    assert eng.stats().preemptions > 0 and eng.stats().images_encoded > 3
    assert [c.token_ids for c in tight] == [c.token_ids for c in reference]
    for a, b in zip(tight, reference):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("static_decode", [False, True])
def test_image_ids_are_never_sampled_and_logprobs_stay_full_vocabulary(images, static_decode):
    """Also through the static decode pass, which samples inside the pass (banned ids included)."""
    m = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny-vl")).init_weights(std=0.1, seed=4).eval()
    imgs = images[:1]
    ids = prompt(imgs, m.vision.config)
    banned = list(m.vision_token_ids)
    with torch.no_grad():  # point the image ids' lm_head rows at the prompt's last hidden state
        h_D = m.hidden_states(torch.tensor(ids)[None], images=imgs)[0, -1]
        m.lm_head.weight[banned] = h_D / h_D.square().sum() * 8.0  # logit 8 each: ~98% of the mass
        first_V = m.forward(torch.tensor(ids)[None], images=imgs)[0, -1]
    assert first_V.argmax().item() in banned and torch.softmax(first_V, -1)[banned].sum() > 0.9
    for sp in (SP, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)):
        eng = engine(m, static_decode=static_decode)
        out = eng.generate([Request(ids, sp, n=3 if sp.temperature else 1, seed=1, images=imgs)])
        assert (eng.runner.sampled_in_pass > 0) == static_decode
        for c in out:
            assert not set(c.token_ids) & set(banned)
            assert c.logprobs[0] < -3.0  # full-vocabulary log-prob: the banned ids keep their mass
            torch.testing.assert_close(c.logprobs, learner_logprobs(m, c, imgs), atol=1e-5, rtol=0)


def test_features_are_cached_per_image_across_requests_within_a_row_bound(model, images):
    vcfg = model.vision.config
    a, b, _ = images
    eng = engine(model, image_cache_rows=30)
    eng.generate([Request(prompt([a, b], vcfg), SP, seed=0, images=(a, b))])
    assert (eng.stats().images_encoded, eng.stats().image_cache_hits) == (2, 0)
    assert eng.images.num_rows <= 30  # a (12 rows) and b (25 rows) do not both fit: one was evicted
    first = eng.generate([Request(prompt([b, b], vcfg), SP, seed=1, images=(b, b))])
    st = eng.stats()
    assert st.images_encoded + st.image_cache_hits == 4 and st.image_cache_hits >= 1
    assert_matches_learner(model, first, [b, b])
    no_cache = engine(model, image_cache_rows=0)
    again = no_cache.generate([Request(prompt([b, b], vcfg), SP, seed=1, images=(b, b))])
    assert no_cache.images.num_rows == 0 and again[0].token_ids == first[0].token_ids


def test_projector_adapter_swap_recomputes_cached_features(images):
    m = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny-vl")).init_weights(std=0.1, seed=6)
    m = with_random_adapter(m, seed=2, projector=True)
    imgs = images[:1]
    req = Request(prompt(imgs, m.vision.config), SP, seed=2, images=imgs)
    eng = engine(m)
    before = eng.generate([req])[0]
    tensors = {
        k: (v * 3 if ".multi_modal_projector." in k else v.clone()) for k, v in lora_state_dict(m).items()
    }
    eng.set_adapter(tensors, version=1)
    after = eng.generate([req])[0]
    assert eng.stats().images_encoded == 2  # the cached features were dropped at the swap
    assert (before.logprobs - after.logprobs).abs().max() > 1e-4
    assert_matches_learner(m, [after], imgs)


def test_bad_image_requests_fail_before_any_compute(model, images):
    vcfg = model.vision.config
    a, b, _ = images
    eng = engine(model)
    cases = [
        (Request(prompt([a], vcfg), SP, images=(a, b)), "placeholder tokens"),
        (Request(prompt([a], vcfg), SP), "placeholder tokens"),  # placeholders, no image
        (Request(prompt([a] * 5, vcfg), SP, images=(a,) * 5), "max_images_per_request"),
        (Request(prompt([a], vcfg), SP, images=(dataclasses.replace(a, num_tokens=3),)), "disagree"),
        (Request((1, vcfg.video_token_id, 5), SP), "video"),
    ]
    for req, match in cases:
        with pytest.raises(ImageInputError, match=match):
            eng.generate([req])
    assert eng.stats().steps == 0 and not eng.has_unfinished()
    text_model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(seed=0).eval()
    with pytest.raises(ValueError, match="no vision tower"):
        engine(text_model).generate([Request(prompt([a], vcfg), SP, images=(a,))])
    with pytest.raises(ValueError, match="ProcessedImage"):
        Request((1, 2), SP, images=("not an image",))
