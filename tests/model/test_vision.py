"""Vision inputs: config parsing, preprocessing, tower features vs a slow reference, placement of
image features, chat expansion, weight loading, and clear errors for bad images."""

import base64
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from common.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from model.vision import (
    ImageInputError,
    VisionConfig,
    VisionModel,
    VisionWeightError,
    chat_to_ids_and_images,
    load_images,
    load_vision_checkpoint,
    load_vision_weights,
    merge_image_features,
    preprocess_image,
    vision_state_for_save,
)
from model.vision.preprocess import num_image_tokens, patchify, smart_resize

TINY = VisionConfig.preset("tiny")


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()},
    }


def random_image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


# --------------------------------------------------------------------------- slow reference
def ref_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ref_rotate(v, pos, cfg):
    """Rotate one head vector: dim j < R/2 pairs with j + R/2; its angle is pos[axis] * inv_freq."""
    a, R = cfg.rope_axis_dim, cfg.rotary_dim
    out = v.clone()
    for j in range(R // 2):
        axis, i = divmod(j, a // 2)
        theta = pos[axis] * cfg.rope_theta ** (-2.0 * i / a)
        c, s = math.cos(theta), math.sin(theta)
        out[j] = v[j] * c - v[j + R // 2] * s
        out[j + R // 2] = v[j + R // 2] * c + v[j] * s
    return out


def ref_image_features(model: VisionModel, x_CHW: torch.Tensor) -> torch.Tensor:
    """One image, spelled out: cut patch (r, c) from the image, Conv3d over the repeated frame,
    per-patch RoPE, explicit softmax attention per head, LayerNorms and GELU by formula, then 2x2
    groups gathered by their (row, column) coordinates, row-major over the merged grid."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    pre = "vision_tower.vision_model."
    p, m, T = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = x_CHW.shape[1] // p, x_CHW.shape[2] // p
    coords = [(r, c) for r in range(gh) for c in range(gw)]
    x = x_CHW.double()
    patches = torch.stack(
        [x[:, r * p : (r + 1) * p, c * p : (c + 1) * p].unsqueeze(1).expand(-1, T, -1, -1) for r, c in coords]
    )
    w_conv = sd[pre + "embeddings.patch_embedding.weight"]
    h = torch.nn.functional.conv3d(patches, w_conv, stride=(T, p, p)).flatten(1)  # [P, D]
    h = ref_layer_norm(h, sd[pre + "pre_layrnorm.weight"], sd[pre + "pre_layrnorm.bias"], cfg.layer_norm_eps)
    H, d = cfg.num_attention_heads, cfg.head_dim
    for li in range(cfg.num_hidden_layers):
        L = f"{pre}encoder.layers.{li}."

        def lin(name, v, L=L):
            return v @ sd[L + name + ".weight"].T + sd[L + name + ".bias"]

        a_in = ref_layer_norm(h, sd[L + "layer_norm1.weight"], sd[L + "layer_norm1.bias"], cfg.layer_norm_eps)
        q, k, v = (
            lin(n, a_in).view(len(coords), H, d)
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        )
        q = torch.stack(
            [
                torch.stack([ref_rotate(q[i, hh], (0, *coords[i]), cfg) for hh in range(H)])
                for i in range(len(coords))
            ]
        )
        k = torch.stack(
            [
                torch.stack([ref_rotate(k[i, hh], (0, *coords[i]), cfg) for hh in range(H)])
                for i in range(len(coords))
            ]
        )
        heads = []
        for hh in range(H):
            scores = q[:, hh] @ k[:, hh].T / math.sqrt(d)
            heads.append(torch.softmax(scores, dim=-1) @ v[:, hh])
        h = h + lin("self_attn.out_proj", torch.cat(heads, dim=-1))
        m_in = ref_layer_norm(h, sd[L + "layer_norm2.weight"], sd[L + "layer_norm2.bias"], cfg.layer_norm_eps)
        h = h + lin("mlp.fc2", ref_gelu(lin("mlp.fc1", m_in)))

    def mlp(prefix, v):
        t = ref_gelu(v @ sd[prefix + "linear_1.weight"].T + sd[prefix + "linear_1.bias"])
        return t @ sd[prefix + "linear_2.weight"].T + sd[prefix + "linear_2.bias"]

    proj = mlp("multi_modal_projector.", h)
    index = {rc: i for i, rc in enumerate(coords)}
    tokens = []
    for R in range(gh // m):
        for C in range(gw // m):
            group = [proj[index[(R * m + dr, C * m + dc)]] for dr in range(m) for dc in range(m)]
            tokens.append(mlp("patch_merge_mlp.", torch.cat(group)))
    return torch.stack(tokens)


# --------------------------------------------------------------------------- config
def released_vision_dicts():
    """Shaped like MiniMax-M3's released config.json (nested compression config, rope_theta)."""
    vision = {
        "model_type": "clip_vision_model", "hidden_size": 1280, "intermediate_size": 5120,
        "num_hidden_layers": 32, "num_attention_heads": 16, "patch_size": 14, "image_size": 2016,
        "projection_dim": 6144, "position_embedding_type": "rope", "rope_mode": "3d",
        "rope_theta": 10000.0, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
        "img_token_compression_config": {
            "image_token_compression_method": "patch_merge", "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_segment_max_frames": 4,
    }  # fmt: skip
    top = {
        "image_token_index": 200025, "video_token_index": 200026, "image_seq_length": 576,
        "process_image_mode": "dynamic_res", "projector_hidden_act": "gelu", "projector_hidden_size": 6144,
        "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
        "multimodal_projector_bias": True,
    }  # fmt: skip
    return vision, top


def test_released_config_json_parses_to_m3_defaults():
    vision, top = released_vision_dicts()
    cfg = VisionConfig.from_hf_dict(vision, top, text_hidden_size=6144)
    assert cfg == VisionConfig.preset("m3")
    assert (cfg.head_dim, cfg.rotary_dim, cfg.patch_dim, cfg.max_tokens_per_image) == (80, 78, 1176, 576)


def test_transformers_port_config_parses_to_the_same_config():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

    d = MiniMaxM3VLConfig().to_dict()
    top = {
        k: d[k]
        for k in ("image_token_index", "video_token_index", "projector_hidden_size", "merged_hidden_size")
    }
    cfg = VisionConfig.from_hf_dict(d["vision_config"], top, text_hidden_size=d["text_config"]["hidden_size"])
    assert cfg == VisionConfig.preset("m3")


@pytest.mark.parametrize(
    "cfg",
    [
        VisionConfig.preset("m3"),
        TINY,
        TINY.replace(vision_start_token_id=None, vision_end_token_id=None, weight_dtype="mxfp8"),
    ],
)
def test_to_hf_dict_round_trips(cfg):
    vision, top = json.loads(json.dumps(cfg.to_hf_dict()))
    assert VisionConfig.from_hf_dict(vision, top, text_hidden_size=cfg.text_hidden_size) == cfg


@pytest.mark.parametrize(
    "vision_patch, top_patch, match",
    [
        ({"num_registers": 4}, {}, "unknown key vision_config.num_registers"),
        ({"hidden_act": "quick_gelu"}, {}, "quick_gelu.*not supported"),
        ({}, {"vision_feature_layer": -2}, "vision_feature_layer=-2 is not supported"),
        ({}, {"image_grid_pinpoints_extra": 1}, "unknown top-level multimodal keys"),
        ({"img_token_compression_config": {"spatial_merge_size": 3}}, {}, "disagrees"),
        ({}, {"merged_hidden_size": 1000}, "merged_hidden_size=1000 disagrees"),
    ],
)
def test_from_hf_dict_rejects_unknown_or_unsupported_keys(vision_patch, top_patch, match):
    vision, top = released_vision_dicts()
    if "img_token_compression_config" in vision_patch:
        top["img_token_compression_config"] = vision_patch.pop("img_token_compression_config")
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_hf_dict({**vision, **vision_patch}, {**top, **top_patch}, text_hidden_size=6144)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": 66}, "multiple of num_attention_heads"),
        ({"weight_dtype": "mxfp8", "intermediate_size": 144}, "multiple of 32; mlp.fc2 has 144"),
        ({"weight_dtype": "fp4"}, "weight_dtype='fp4'"),
        ({"image_token_id": 502}, "distinct"),
        ({"vision_end_token_id": None}, "set both"),
        ({"min_pixels": 10_000}, "min_pixels=10000 > max_pixels"),
        ({"image_mean": (0.5, 0.5)}, "one value per channel"),
    ],
)
def test_invalid_vision_config_fails_with_named_field(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_tiny_placeholder_ids_fit_the_tiny_vocab_and_avoid_byte_ids():
    vocab = ModelConfig.preset("tiny").vocab_size
    ids = [TINY.image_token_id, TINY.video_token_id, TINY.vision_start_token_id, TINY.vision_end_token_id]
    assert all(ByteTokenizer.vocab_size <= i < vocab for i in ids)
    assert TINY.text_hidden_size == ModelConfig.preset("tiny").hidden_size


# --------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize(
    "hw, expected",
    [((28, 28), (56, 56)), ((100, 200), (112, 196)), ((1000, 3000), (364, 1148)), ((14, 2000), (28, 1988))],
)
def test_smart_resize_matches_hand_computed_m3_sizes(hw, expected):
    assert smart_resize(*hw, VisionConfig()) == expected


def test_smart_resize_keeps_factor_area_bounds_and_aspect_on_random_sizes():
    cfg, rng = VisionConfig(), np.random.RandomState(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.randint(20, 5000, size=2))
        rh, rw = smart_resize(h, w, cfg)
        assert rh % 28 == 0 and rw % 28 == 0
        assert cfg.min_pixels <= rh * rw <= cfg.max_pixels
        assert abs(math.log((rh / rw) / (h / w))) < 0.7


def test_solid_color_image_normalises_to_clip_values_in_every_patch_value():
    cfg = VisionConfig()
    out = preprocess_image(Image.new("RGB", (56, 56), (255, 0, 128)), cfg)
    assert out.grid_thw == (1, 4, 4) and out.num_tokens == 4
    assert out.pixel_values.shape == (16, 1176)
    expected = [(v / 255 - m) / s for v, m, s in zip((255, 0, 128), cfg.image_mean, cfg.image_std)]
    rows = out.pixel_values.view(16, 3, 2 * 14 * 14)
    for c in range(3):
        torch.testing.assert_close(rows[:, c], torch.full_like(rows[:, c], expected[c]), rtol=0, atol=1e-6)


def test_patch_rows_are_merge_block_major_with_repeated_frames():
    cfg = TINY  # patch 4, merge 2
    img = random_image(24, 16, seed=1)  # multiples of 8: no resize; grid 4 x 6
    out = preprocess_image(img, cfg)
    assert out.grid_thw == (1, 4, 6) and out.num_tokens == 6
    arr = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255
    norm = (arr - torch.tensor(cfg.image_mean).view(3, 1, 1)) / torch.tensor(cfg.image_std).view(3, 1, 1)
    p, m = 4, 2
    row = 0
    for R in range(2):
        for C in range(3):
            for dr in range(m):
                for dc in range(m):
                    r, c = R * m + dr, C * m + dc
                    want = norm[:, r * p : (r + 1) * p, c * p : (c + 1) * p]
                    got = out.pixel_values[row].view(3, 2, p, p)
                    torch.testing.assert_close(got[:, 0], want, rtol=0, atol=1e-6)
                    torch.testing.assert_close(got[:, 1], want, rtol=0, atol=0)
                    row += 1


@pytest.mark.parametrize("wh", [(10, 10), (50, 100), (640, 480), (3, 500)])
def test_resized_patch_counts_agree_with_token_count_helper(wh):
    out = preprocess_image(random_image(*wh), TINY)
    _, gh, gw = out.grid_thw
    assert out.pixel_values.shape == (gh * gw, TINY.patch_dim)
    assert out.num_tokens == gh * gw // 4 == num_image_tokens(wh[1], wh[0], TINY)
    assert (gh * 4, gw * 4) == smart_resize(wh[1], wh[0], TINY)


def test_resize_keeps_constant_images_constant_and_tracks_pil_bicubic_on_smooth_images():
    from model.vision.preprocess import resize_uint8

    flat = torch.full((3, 30, 50), 77, dtype=torch.uint8)
    assert resize_uint8(flat, 16, 24).eq(77).all()
    yy, xx = np.mgrid[0:60, 0:90]
    smooth = np.stack([yy * 2, xx * 2, (yy + xx)], -1).astype(np.uint8)
    ours = resize_uint8(torch.from_numpy(smooth.copy()).permute(2, 0, 1), 30, 45)
    pil = np.asarray(Image.fromarray(smooth).resize((45, 30), Image.BICUBIC))
    assert (ours - torch.from_numpy(pil.copy()).permute(2, 0, 1).float()).abs()[:, 2:-2, 2:-2].max() <= 1


# --------------------------------------------------------------------------- errors
def test_malformed_base64_is_a_clear_error():
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}
    with pytest.raises(ImageInputError, match="not valid base64"):
        load_images([part], TINY)


def test_truncated_png_is_a_clear_error():
    data = png_bytes(random_image(32, 32))
    with pytest.raises(ImageInputError, match=r"truncated or corrupt|not a decodable image"):
        load_images([data_url(data[: len(data) // 2])], TINY)


def test_non_image_bytes_are_a_clear_error():
    with pytest.raises(ImageInputError, match="not a decodable image"):
        load_images([data_url(b"hello, I am text")], TINY)


def test_oversized_encoded_image_is_refused_before_decoding():
    data = png_bytes(random_image(700, 700))  # ~1.5 MB of noise > tiny's 1 MiB
    assert len(data) > TINY.max_image_bytes
    with pytest.raises(ImageInputError, match="max_image_bytes"):
        load_images([data_url(data)], TINY)


def test_image_with_too_many_declared_pixels_is_refused():
    data = png_bytes(Image.new("RGB", (2000, 1000)))  # tiny in bytes, 2M pixels > 1M
    with pytest.raises(ImageInputError, match="max_source_pixels"):
        load_images([data_url(data)], TINY)


def test_too_many_images_is_refused_before_any_image_is_read():
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
    with pytest.raises(ImageInputError, match="5 images; max_images_per_request=4"):
        load_images([bad] * 5, TINY)


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png"])
def test_http_urls_are_refused_with_no_network_message(url):
    with pytest.raises(ImageInputError, match="no network"):
        load_images([{"type": "image_url", "image_url": {"url": url}}], TINY)


def test_unsupported_format_and_extreme_aspect_ratio_are_clear_errors():
    with pytest.raises(ImageInputError, match="format TIFF is not supported"):
        load_images([data_url(png_bytes(random_image(16, 16), "TIFF"))], TINY)
    with pytest.raises(ImageInputError, match="aspect ratio"):
        load_images([data_url(png_bytes(random_image(1000, 4)))], TINY)


def test_file_url_and_local_path_load_the_same_pixels(tmp_path):
    path = tmp_path / "a b.png"
    path.write_bytes(png_bytes(random_image(20, 12)))
    a, b = load_images(
        [
            {"type": "image_url", "image_url": {"url": f"file://{path}"}},
            {"type": "image_url", "image_url": {"url": str(path)}},
        ],
        TINY,
    )
    assert a.sha256 == b.sha256 and torch.equal(a.pixel_values, b.pixel_values)
    with pytest.raises(ImageInputError, match="does not exist"):
        load_images([{"type": "image_url", "image_url": {"url": str(tmp_path / "missing.png")}}], TINY)


# --------------------------------------------------------------------------- tower
def normalised_image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randn(3, h, w, generator=torch.Generator().manual_seed(seed))


def peaky_model(seed: int, std: float = 0.05, qk_std: float = 0.5) -> VisionModel:
    """Small weights keep fp32 rounding far below 1e-5, while large q/k weights make attention
    peaked, so a wrong RoPE position or layout moves the features by ~3e-2 (checked by mutation)."""
    model = VisionModel(TINY).init_weights(std=std, seed=seed)
    with torch.no_grad():
        for layer in model.vision_tower.vision_model.encoder.layers:
            layer.self_attn.q_proj.weight.mul_(qk_std / std)
            layer.self_attn.k_proj.weight.mul_(qk_std / std)
    return model


def test_image_features_equal_slow_reference_in_fp32():
    model = peaky_model(seed=3)
    imgs = [normalised_image(16, 24, 0), normalised_image(8, 16, 1)]  # grids 4x6 and 2x4
    pixel_values = torch.cat([patchify(x, TINY) for x in imgs])
    grids = [(1, 4, 6), (1, 2, 4)]
    with torch.no_grad():
        feats = model.image_features(pixel_values, grids)
    assert feats.shape == (6 + 2, TINY.text_hidden_size)
    ref = torch.cat([ref_image_features(model, x) for x in imgs]).float()
    torch.testing.assert_close(feats, ref, rtol=1e-5, atol=1e-5)


def test_image_features_do_not_depend_on_other_images_in_the_batch():
    model = peaky_model(seed=4)
    a, b = patchify(normalised_image(16, 16, 2), TINY), patchify(normalised_image(8, 24, 3), TINY)
    with torch.no_grad():
        alone = model.image_features(a, [(1, 4, 4)])
        both = model.image_features(torch.cat([b, a]), [(1, 2, 6), (1, 4, 4)])
    torch.testing.assert_close(both[3:], alone, rtol=1e-6, atol=1e-6)


def test_single_image_matches_transformers_minimax_m3_vl_port():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLModel

    vision, _ = TINY.to_hf_dict()
    hf_vision = {k: vision[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "patch_size", "temporal_patch_size",
                                        "spatial_merge_size", "layer_norm_eps")}  # fmt: skip
    text = {"hidden_size": 128, "num_hidden_layers": 1, "vocab_size": 512, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 64, "index_n_heads": 2, "rotary_dim": 16,
            "num_local_experts": 2, "num_experts_per_tok": 1, "mlp_layer_types": ["dense"]}  # fmt: skip
    hf_cfg = MiniMaxM3VLConfig(vision_config=hf_vision, text_config=text, projector_hidden_size=128)
    hf = MiniMaxM3VLModel(hf_cfg).eval()
    ours = peaky_model(seed=5)
    rename = [("vision_tower.vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.proj."),
              ("vision_tower.vision_model.encoder.layers.", "vision_tower.layers."),
              ("vision_tower.vision_model.pre_layrnorm.", "vision_tower.pre_layrnorm."),
              ("patch_merge_mlp.linear_", "multi_modal_projector.merge_linear_")]  # fmt: skip
    hf_sd = hf.state_dict()
    for name, t in ours.state_dict().items():
        for a, b in rename:
            name = name.replace(a, b)
        hf_sd[name].copy_(t)
    pixel_values = patchify(normalised_image(16, 24, 7), TINY)
    with torch.no_grad():
        want = hf.get_image_features(pixel_values, torch.tensor([[1, 4, 6]])).pooler_output[0]
        got = ours.image_features(pixel_values, [(1, 4, 6)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_long_video_grid_attends_in_segments_of_max_frames():
    model = peaky_model(seed=6)  # tiny: vision_segment_max_frames = 4
    pv = torch.randn(6 * 2 * 4, TINY.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model.image_features(pv, [(6, 2, 4)])
        parts = model.image_features(pv, [(4, 2, 4), (2, 2, 4)])
    assert whole.shape == (12, TINY.text_hidden_size)
    torch.testing.assert_close(whole, parts, rtol=0, atol=0)


def test_bf16_tower_runs_and_stays_near_fp32():
    model = peaky_model(seed=7)
    pv = patchify(normalised_image(16, 16, 8), TINY)
    with torch.no_grad():
        ref = model.image_features(pv, [(1, 4, 4)])
        got = model.to(torch.bfloat16).image_features(pv, [(1, 4, 4)])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.02)


def test_mismatched_grid_or_patch_width_is_a_clear_error():
    model = VisionModel(TINY).init_weights()
    with pytest.raises(ValueError, match="describe 24 patches but pixel_values has 8"):
        model.image_features(torch.zeros(8, TINY.patch_dim), [(1, 4, 6)])
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        model.image_features(torch.zeros(12, TINY.patch_dim), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"\[patches, 96\]"):
        model.image_features(torch.zeros(8, 10), [(1, 2, 4)])


# --------------------------------------------------------------------------- text stream
def test_merge_places_features_exactly_at_placeholders_in_reading_order():
    img = TINY.image_token_id
    ids = torch.tensor([[5, img, img, 7, 8, img], [img, 9, 9, 9, img, 3]])
    embeds = torch.randn(2, 6, 4)
    feats = torch.arange(20, dtype=torch.float32).view(5, 4)
    out = merge_image_features(embeds, ids, feats, img)
    positions = [(0, 1), (0, 2), (0, 5), (1, 0), (1, 4)]
    for k, (b, s) in enumerate(positions):
        assert torch.equal(out[b, s], feats[k])
    keep = ids != img
    assert torch.equal(out[keep], embeds[keep])
    with pytest.raises(ValueError, match=r"5 image placeholder tokens .* but 4 image feature rows"):
        merge_image_features(embeds, ids, feats[:4], img)


def test_merge_passes_gradients_to_features_and_text_embeddings():
    ids = torch.tensor([1, TINY.image_token_id, 2])
    embeds = torch.randn(3, 4, requires_grad=True)
    feats = torch.randn(1, 4, requires_grad=True)
    merge_image_features(embeds, ids, feats, TINY.image_token_id).sum().backward()
    assert feats.grad.eq(1).all()
    assert embeds.grad[1].eq(0).all() and embeds.grad[0].eq(1).all()


def test_chat_with_two_images_expands_placeholders_around_verbatim_text(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "b.png"
    path.write_bytes(png_bytes(random_image(40, 20, seed=2)))
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            data_url(png_bytes(random_image(24, 16, seed=1))),
            {"type": "text", "text": " and "},
            {"type": "image_url", "image_url": {"url": str(path)}},
        ]},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    out = chat_to_ids_and_images(messages, tok, TINY)
    n1, n2 = (im.num_tokens for im in out.images)
    assert (n1, n2) == (6, num_image_tokens(20, 40, TINY))
    s, e, i = TINY.vision_start_token_id, TINY.vision_end_token_id, TINY.image_token_id
    expected = (
        tok.encode("Compare ") + [s] + [i] * n1 + [e]
        + tok.encode(" and ", add_special_tokens=False) + [s] + [i] * n2 + [e]
        + tok.encode("\nok\n", add_special_tokens=False)
    )  # fmt: skip
    assert out.input_ids == expected
    assert out.num_image_tokens == sum(1 for t in out.input_ids if t == i)


def test_chat_placeholders_receive_features_of_their_own_image():
    tok = ByteTokenizer()
    img_a, img_b = png_bytes(random_image(16, 16, seed=5)), png_bytes(random_image(24, 8, seed=6))
    messages = [
        {"role": "user", "content": [data_url(img_a), {"type": "text", "text": "?"}, data_url(img_b)]}
    ]
    out = chat_to_ids_and_images(messages, tok, TINY)
    model = VisionModel(TINY).init_weights(std=0.2)
    pv = torch.cat([im.pixel_values for im in out.images])
    with torch.no_grad():
        feats = model.image_features(pv, [im.grid_thw for im in out.images])
        alone_b = model.image_features(out.images[1].pixel_values, [out.images[1].grid_thw])
    ids = torch.tensor(out.input_ids)
    merged = merge_image_features(
        torch.zeros(len(ids), TINY.text_hidden_size), ids, feats, TINY.image_token_id
    )
    torch.testing.assert_close(
        merged[ids == TINY.image_token_id][-alone_b.shape[0] :], alone_b, rtol=1e-6, atol=1e-6
    )


def test_chat_limits_and_bad_parts_are_clear_errors():
    tok = ByteTokenizer()
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
    with pytest.raises(ImageInputError, match="max_images_per_request=4"):
        chat_to_ids_and_images([{"role": "user", "content": [bad] * 5}], tok, TINY)
    with pytest.raises(ImageInputError, match="unsupported part 'audio'"):
        chat_to_ids_and_images([{"role": "user", "content": [{"type": "audio"}]}], tok, TINY)
    with pytest.raises(ImageInputError, match="no network"):
        chat_to_ids_and_images(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
            tok,
            TINY,
        )


# --------------------------------------------------------------------------- weights
def test_save_then_load_uses_released_names_and_reproduces_features(tmp_path):
    src = VisionModel(TINY).init_weights(std=0.2, seed=8)
    state = vision_state_for_save(src)
    assert state["vision_tower.vision_model.embeddings.patch_embedding.weight"].shape == (64, 3, 2, 4, 4)
    assert "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.bias" in state
    assert "vision_tower.vision_model.pre_layrnorm.weight" in state
    assert state["multi_modal_projector.linear_1.weight"].shape == (128, 64)
    assert state["patch_merge_mlp.linear_1.weight"].shape == (128, 512)
    # A sharded checkpoint whose text shard is garbage: only the vision shard may be read.
    save_file(state, str(tmp_path / "vision.safetensors"))
    (tmp_path / "text.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {n: "vision.safetensors" for n in state} | {
        "language_model.model.embed_tokens.weight": "text.safetensors"
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    dst = load_vision_checkpoint(VisionModel(TINY), tmp_path)
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), n
    pv = patchify(normalised_image(8, 8, 9), TINY)
    with torch.no_grad():
        assert torch.equal(src.image_features(pv, [(1, 2, 2)]), dst.image_features(pv, [(1, 2, 2)]))


def test_mxfp8_vision_weights_load_dequantized_when_configured(tmp_path):
    cfg = TINY.replace(weight_dtype="mxfp8")
    src = VisionModel(cfg).init_weights(std=0.2, seed=9)
    state = vision_state_for_save(src)
    q = state["vision_tower.vision_model.encoder.layers.0.mlp.fc2.weight"]
    assert q.dtype == torch.float8_e4m3fn
    assert state["vision_tower.vision_model.encoder.layers.0.mlp.fc2.weight_scale_inv"].dtype == torch.uint8
    assert state["vision_tower.vision_model.pre_layrnorm.weight"].dtype == torch.float32
    save_file(state, str(tmp_path / "model.safetensors"))
    dst = load_vision_checkpoint(VisionModel(cfg), tmp_path)
    w = src.vision_tower.vision_model.encoder.layers[0].mlp.fc2.weight.detach()
    values, scales = quantize_mxfp8(w)
    assert torch.equal(
        dst.vision_tower.vision_model.encoder.layers[0].mlp.fc2.weight, dequantize_mxfp8(values, scales)
    )
    with pytest.raises(
        VisionWeightError, match="stored as mxfp8 but the vision config says weight_dtype='bf16'"
    ):
        load_vision_checkpoint(VisionModel(TINY), tmp_path)


def test_nvfp4_vision_weights_are_refused_unless_configured():
    state = vision_state_for_save(VisionModel(TINY.replace(weight_dtype="nvfp4")).init_weights(std=0.2))
    assert state["multi_modal_projector.linear_2.weight"].dtype == torch.uint8
    with pytest.raises(VisionWeightError, match=r"stored as nvfp4 .* used only when configured"):
        load_vision_weights(VisionModel(TINY.replace(weight_dtype="mxfp8")), state)
    load_vision_weights(VisionModel(TINY.replace(weight_dtype="nvfp4")), state)


def test_missing_unexpected_and_misshaped_tensors_are_named():
    state = vision_state_for_save(VisionModel(TINY).init_weights())
    name = "vision_tower.vision_model.encoder.layers.1.mlp.fc1.bias"
    with pytest.raises(VisionWeightError, match="missing from the checkpoint"):
        load_vision_weights(VisionModel(TINY), {k: v for k, v in state.items() if k != name})
    with pytest.raises(
        VisionWeightError,
        match=r"unexpected vision tensor 'vision_tower\.vision_model\.post_layernorm\.weight'",
    ):
        load_vision_weights(
            VisionModel(TINY), {**state, "vision_tower.vision_model.post_layernorm.weight": torch.ones(64)}
        )
    with pytest.raises(VisionWeightError, match=f"{name}: checkpoint shape \\(7,\\)"):
        load_vision_weights(VisionModel(TINY), {**state, name: torch.zeros(7)})
