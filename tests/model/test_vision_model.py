"""The causal LM with its vision tower (tiny-vl preset): image features merged at placeholders in the
training forward, a frozen tower that text LoRA never adapts, projector LoRA, and checkpoints that
carry the vision weights under the released names, never NVFP4."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from model.checkpoint import CheckpointError, load_model, save_model
from model.config import ModelConfig, QuantConfig
from model.layers.lora import LoRAConfig, apply_lora
from model.modeling import MiniMaxM3ForCausalLM
from model.vision import apply_projector_lora, placeholder_ids, preprocess_image
from model.vision.weights import VISION_PREFIXES


def build(preset: str = "tiny-vl", seed: int = 0) -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(ModelConfig.preset(preset)).init_weights(std=0.05, seed=seed).eval()


def image(w: int, h: int, seed: int, vcfg):
    pixels = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return preprocess_image(buf.getvalue(), vcfg)


def prompt_with(images, vcfg, text=(10, 20, 30)) -> torch.Tensor:
    ids = [1, *text]
    for im in images:
        ids += placeholder_ids(im.num_tokens, vcfg) + list(text)
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def model() -> MiniMaxM3ForCausalLM:
    return build()


@pytest.fixture(scope="module")
def images(model):
    vcfg = model.vision.config
    return [image(32, 24, 1, vcfg), image(40, 40, 2, vcfg)]


def test_tiny_vl_has_a_frozen_initialised_tower_and_the_text_weights_of_tiny(model):
    assert model.vision is not None and model.vision.config.text_hidden_size == model.config.hidden_size
    assert not any(p.requires_grad for p in model.vision.parameters())
    ln = model.vision.vision_tower.vision_model.pre_layrnorm
    assert torch.equal(ln.weight, torch.ones(64)) and torch.equal(ln.bias, torch.zeros(64))
    text = build("tiny")
    for (name, a), (_, b) in zip(model.model.state_dict().items(), text.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert model.vision_token_ids == (500, 501, 502, 503) and text.vision_token_ids == ()


def test_embeddings_take_each_images_features_at_its_placeholders_and_text_rows_unchanged(model, images):
    vcfg = model.vision.config
    ids_S = prompt_with(images, vcfg)
    # Straightforward reference: one tower call per image, concatenated in prompt order.
    ref_NE = torch.cat([model.vision.image_features(im.pixel_values, [im.grid_thw]) for im in images])
    with torch.no_grad():
        x_SD = model.embed(ids_S, images=images)
        plain_SD = model.model.embed_tokens(ids_S)
    is_img = ids_S == vcfg.image_token_id
    assert int(is_img.sum()) == ref_NE.shape[0]
    torch.testing.assert_close(x_SD[is_img], ref_NE, atol=1e-6, rtol=0)
    assert torch.equal(x_SD[~is_img], plain_SD[~is_img])
    with torch.no_grad():
        by_images = model.forward(ids_S[None], images=images)
        by_features = model.forward(ids_S[None], image_features_NE=ref_NE)
        text_only = model.forward(ids_S[None])
    torch.testing.assert_close(by_images, by_features, atol=1e-5, rtol=0)
    assert (by_images - text_only).abs().max() > 1e-3  # the image content reaches the logits


def test_a_repeated_image_is_encoded_once_with_the_same_features_as_alone(model, images):
    a, b = images
    with torch.no_grad():
        feats = model.vision.encode_images([a, b, a])
        alone = model.vision.encode_images([a])[0]
    assert feats[0] is feats[2]
    torch.testing.assert_close(feats[0], alone, atol=1e-6, rtol=0)


def test_placeholder_count_mismatch_and_text_only_model_are_clear_errors(model, images):
    ids_S = prompt_with(images[:1], model.vision.config)
    with pytest.raises(ValueError, match="placeholder tokens"):
        model.forward(ids_S[None], images=images)  # two images, one span
    with pytest.raises(ValueError, match="no vision tower"):
        build("tiny").forward(ids_S[None], images=images[:1])


def test_text_lora_never_adapts_the_tower_and_the_frozen_tower_gets_no_gradient(images):
    m = apply_lora(build(), LoRAConfig(r=2, alpha=4.0))
    assert not [n for n, _ in m.named_parameters() if n.startswith("vision.") and "lora_" in n]
    m.train()
    ids_S = prompt_with(images, m.vision.config)
    lp, _ = m.token_logprobs(ids_S[None, :-1], ids_S[None, 1:], images=images)
    lp.sum().backward()
    assert all(p.grad is None for p in m.vision.parameters())
    assert all(p.grad is not None for n, p in m.named_parameters() if "lora_A" in n and "layers.0." in n)


def test_projector_lora_trains_through_image_features_and_leaves_the_tower_frozen(images):
    m = apply_projector_lora(apply_lora(build(), LoRAConfig(r=2, alpha=4.0)), r=2, alpha=4.0)
    vision_lora = [n for n, p in m.named_parameters() if n.startswith("vision.") and p.requires_grad]
    assert sorted(vision_lora) == sorted(
        f"vision.{mod}.{lin}.lora_{ab}.weight"
        for mod in ("multi_modal_projector", "patch_merge_mlp") for lin in ("linear_1", "linear_2")
        for ab in "AB"
    )  # fmt: skip
    with torch.no_grad():  # B = 0 at init: nonzero B makes A's gradient nonzero too
        for n, p in m.vision.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids_S = prompt_with(images, m.vision.config)
    lp, _ = m.token_logprobs(ids_S[None, :-1], ids_S[None, 1:], images=images)
    lp.sum().backward()
    grads = {n: p.grad for n, p in m.vision.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for n, p in m.vision.named_parameters() if "lora_" not in n)


def test_checkpoint_round_trip_keeps_vision_features_under_released_names_never_nvfp4(tmp_path, images):
    cfg = dataclasses.replace(
        ModelConfig.preset("tiny-vl"), quantization=QuantConfig(routed_experts="nvfp4", attention="nvfp4")
    )
    m = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=3).eval()
    save_model(m, tmp_path)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_names = [n for n in names if n.startswith(VISION_PREFIXES)]
    assert len(vision_names) == len(list(m.vision.parameters()))
    assert not any(n.startswith("vision.") for n in names)  # the module attribute never reaches disk
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in vision_names
    assert not any(n.endswith(("weight_scale", "weight_scale_2")) for n in vision_names)
    assert any(n.endswith("self_attn.q_proj.weight_scale_2") for n in names)  # text attention is NVFP4
    loaded = load_model(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(m.vision.state_dict().items(), loaded.vision.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(m.image_features(images), loaded.image_features(images))


def test_vision_config_needs_the_checkpoints_vision_tensors_and_text_config_skips_them(tmp_path):
    text_dir, vl_dir = tmp_path / "text", tmp_path / "vl"
    save_model(build("tiny"), text_dir)
    with pytest.raises(CheckpointError, match="vision parameters missing"):
        load_model(text_dir, config=ModelConfig.preset("tiny-vl"), dtype=torch.float32)
    save_model(build("tiny-vl"), vl_dir)
    text_only = load_model(vl_dir, config=ModelConfig.preset("tiny"), dtype=torch.float32)
    assert text_only.vision is None


def test_projector_adapter_exports_under_checkpoint_names_and_reloads_to_equal_features(tmp_path, images):
    from safetensors.torch import load_file

    from model.adapter import load_adapter, read_adapter, save_adapter

    cfg = LoRAConfig(r=2, alpha=4.0, projector_modules=["patch_merge_mlp", "multi_modal_projector"])
    m = apply_lora(build(), cfg)
    with torch.no_grad():  # B = 0 would make the round trip vacuous
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    before = build().image_features(images)
    trained = m.image_features(images)
    assert not torch.allclose(trained, before), "the projector adapter changed nothing: vacuous check"
    save_adapter(m, tmp_path / "a", cfg)
    names = set(load_file(str(tmp_path / "a" / "adapter_model.safetensors")))
    assert "base_model.model.multi_modal_projector.linear_1.lora_A.weight" in names
    assert not any(".vision." in n for n in names)  # released (top-level) projector names
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert "patch_merge_mlp.linear_2" in conf["target_modules"]
    got_cfg, _, _ = read_adapter(tmp_path / "a")
    assert got_cfg.projector_modules == ["multi_modal_projector", "patch_merge_mlp"]
    assert got_cfg.target_modules == cfg.target_modules
    fresh = build()
    load_adapter(fresh, tmp_path / "a", expected=cfg)
    torch.testing.assert_close(fresh.image_features(images), trained, rtol=0, atol=0)


def test_projector_only_adapter_and_unknown_projector_names():
    m = apply_lora(build(), LoRAConfig(r=2, target_modules=[], projector_modules=["multi_modal_projector"]))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("vision.multi_modal_projector.") for n in trainable)
    with pytest.raises(ValueError, match=r"lora.projector_modules: unknown module"):
        LoRAConfig(projector_modules=["vision_tower"])
