"""Image prompts through RolloutWorker and Learner (tiny-vl, CPU, fp32): the learner's log-probs
with the merged image features equal the rollout's (nonzero LoRA, a batch mixing image and text
prompts), image ids are never targets, a train step moves only the adapter, and bad image prompts
fail naming the prompt."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from common.data import Prompt
from model.checkpoint import save_model
from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from model.vision import ImageInputError
from rl.config import load_config
from rl.learner import Learner, collate
from rl.workers import RolloutWorker, Sample

OVERRIDES = (
    "model.checkpoint=null", "model.warmup=false", "model.dtype=fp32", "model.tokenizer=byte",
    "lora.r=4", "lora.alpha=8", "rollout.kv_cache_dtype=fp32", "rollout.index_cache_dtype=fp32",
    "rollout.max_tokens=6", "rollout.max_pages=64", "rollout.max_batch_tokens=24", "rollout.torch_threads=1",
    "trainer.torch_threads=1", "trainer.micro_batch_size=2", "trainer.device=cpu", "algo.batch_prompts=2",
)  # fmt: skip


def png_url(w: int, h: int, seed: int) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_prompt(uid: str, *urls: str) -> Prompt:
    parts = [{"type": "text", "text": "Find x. "}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": " Answer:"})
    return Prompt(uid=uid, messages=[{"role": "user", "content": parts}], ground_truth="3", data_source="t")


def text_prompt(uid: str) -> Prompt:
    return Prompt(uid=uid, messages=[{"role": "user", "content": "1+2="}], ground_truth="3", data_source="t")


def config_and_base(tmp_path, preset: str):
    base = tmp_path / f"base-{preset}"
    save_model(MiniMaxM3ForCausalLM(ModelConfig.preset(preset)).init_weights(std=0.1, seed=0), base)
    cfg = load_config("quickstart", [f"model.preset={preset}", f"output_dir={tmp_path / 'run'}", *OVERRIDES])
    return cfg, str(base)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    n = torch.get_num_threads()
    cfg, base = config_and_base(tmp_path_factory.mktemp("vl"), "tiny-vl")
    worker, learner = RolloutWorker(cfg, base), Learner(cfg, base)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a nonzero adapter on the learner, synced to the engine as in training
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    learner.version = 1
    worker.set_adapter(learner.adapter_update())
    yield worker, learner
    torch.set_num_threads(n)


def test_learner_logprobs_with_images_equal_rollout_logprobs_in_a_mixed_batch(vl):
    worker, learner = vl
    prompts = [image_prompt("img", png_url(32, 24, 1), png_url(40, 40, 2)), text_prompt("txt")]
    samples = worker.generate(prompts, n=2, temperature=1.0, top_p=1.0, seed=0, min_version=1)
    img, txt = [s for s in samples if s.uid == "img"], [s for s in samples if s.uid == "txt"]
    assert [len(s.images) for s in samples] == [2, 2, 0, 0] and img[0].images is img[1].images
    placeholder = learner.model.vision.config.image_token_id
    assert img[0].prompt_ids.count(placeholder) == sum(im.num_tokens for im in img[0].images)
    assert txt[0].prompt_ids == worker.tokenizer.encode("1+2=\n")  # the text path is unchanged
    batch = collate(samples, learner.model.vision_token_ids)
    assert len(batch["images"]) == 4
    with torch.no_grad():
        logp_BT, _ = learner._logprobs(batch, with_entropy=False)
    mask = batch["mask"].bool()
    assert not mask[batch["targets"] == placeholder].any()
    diff = (logp_BT - batch["rollout_logp"])[mask].abs().max()
    assert diff <= 1e-5, diff


def test_train_step_on_image_samples_moves_the_adapter_not_the_tower(vl):
    worker, learner = vl
    samples = worker.generate([image_prompt("img2", png_url(24, 32, 3))], n=2, temperature=1.0, top_p=1.0,
                              seed=1, min_version=1)  # fmt: skip
    for s, adv in zip(samples, (1.0, -1.0)):
        s.advantage = adv
    tower = {k: v.clone() for k, v in learner.model.vision.state_dict().items()}
    adapter = {k: v.clone() for k, v in learner.adapter_update().tensors.items()}
    metrics = learner.train_step(samples)
    assert all(np.isfinite(v) for v in metrics.values()) and metrics["actor/nonfinite_updates"] == 0
    assert all(torch.equal(v, learner.model.vision.state_dict()[k]) for k, v in tower.items())
    after = learner.adapter_update().tensors
    assert any(not torch.equal(v, after[k]) for k, v in adapter.items())


def test_collate_never_targets_image_ids_even_inside_a_response():
    s = Sample(uid="u", prompt_ids=[1, 502, 500, 503, 7], response_ids=[8, 500, 9],
               rollout_logprobs=[0.0] * 3, finish_reason="length", adapter_version=0)  # fmt: skip
    batch = collate([s], (500, 501, 502, 503))
    assert batch["mask"][0].tolist() == [0, 0, 0, 0, 1, 0, 1]
    assert batch["images"] == []


def test_bad_image_prompts_fail_naming_the_prompt(vl, tmp_path):
    worker, _ = vl
    broken = image_prompt("broken-row", "data:image/png;base64,iVBORw0KGgo=")  # a PNG signature only
    with pytest.raises(ImageInputError, match=r"broken-row.*image 0"):
        worker.generate([broken], n=1, temperature=1.0, top_p=1.0, seed=0, min_version=1)
    huge = image_prompt("huge", "data:image/png;base64," + "A" * (2 << 20))
    with pytest.raises(ImageInputError, match=r"huge.*max_image_bytes"):
        worker.generate([huge], n=1, temperature=1.0, top_p=1.0, seed=0, min_version=1)
    text_worker = RolloutWorker(*config_and_base(tmp_path, "tiny"))
    with pytest.raises(ValueError, match=r"'img'.*no vision tower"):
        text_worker.generate(
            [image_prompt("img", png_url(32, 24, 1))], n=1, temperature=1.0, top_p=1.0, seed=0
        )
