"""ModelConfig / QuantConfig: presets, validation, and both config.json styles (load + round trip)."""

import dataclasses
import json

import pytest

from model.capacity import num_parameters
from model.config import PRESETS, ModelConfig, QuantConfig
from model.hf_config import IGNORED_HF_KEYS


def legacy_m3_text_dict() -> dict:
    """Style (a): shaped like the MiniMax-M3 `minimax_m3_text` config.json vLLM loads."""
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_text",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "vocab_size": 200064,
        "hidden_size": 6144,
        "intermediate_size": 3072,
        "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072,
        "num_hidden_layers": 60,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 524288,
        "rms_norm_eps": 1e-6,
        "use_gemma_norm": True,
        "attention_output_gate": False,
        "rope_theta": 5000000,
        "rotary_dim": 64,
        "partial_rotary_factor": 0.5,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "num_mtp_modules": 1,
        "moe_layer_freq": [0] * 3 + [1] * 57,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": 128,
            "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16,
            "sparse_block_size": 128,
            "sparse_disable_index_value": [0] * 3 + [1] * 57,
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_attention_freq": [0] * 3 + [1] * 57,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 200034,
        "eos_token_id": 200020,
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "kv_cache_quant_algo": "FP8",
            "group_size": 32,
            "ignore": [
                "lm_head",
                "model.embed_tokens",
                "*self_attn*",
                "*.mlp.*",
                "*shared_experts*",
                "*block_sparse_moe.gate",
            ],
        },
    }


def vl_tiny_dict() -> dict:
    """Style (b): transformers-port `minimax_m3_vl` with text_config / vision_config, tiny sizes, and
    a MIXED_PRECISION ModelOpt config listing every quantized module the way ModelOpt exports it."""
    layers = 4
    mixed = {}
    for i in range(layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mixed[f"model.layers.{i}.self_attn.{n}"] = {"quant_algo": "MXFP8", "group_size": 32}
        if i == 0:
            for n in ("gate_proj", "up_proj", "down_proj"):
                mixed[f"model.layers.{i}.mlp.{n}"] = {"quant_algo": "MXFP8", "group_size": 32}
            continue
        for n in ("index_q_proj", "index_k_proj"):
            mixed[f"model.layers.{i}.self_attn.{n}"] = {"quant_algo": "MXFP8", "group_size": 32}
        for n in ("gate_proj", "up_proj", "down_proj"):
            mixed[f"model.layers.{i}.block_sparse_moe.shared_experts.{n}"] = {"quant_algo": "MXFP8"}
        for e in range(8):
            for w in ("w1", "w2", "w3"):
                mixed[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"] = {
                    "quant_algo": "W4A16_NVFP4",
                    "group_size": 16,
                }
    return {
        "architectures": ["MiniMaxM3VLForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "image_token_index": 200025,
        "video_token_index": 200026,
        "projector_hidden_size": 128,
        "tie_word_embeddings": False,
        "vision_config": {"hidden_size": 64, "num_hidden_layers": 2, "patch_size": 14, "model_type": "x"},
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "NVFP4",
            "ignore": ["lm_head", "model.embed_tokens", "*block_sparse_moe.gate"],
            "quantized_layers": mixed,
        },
        "text_config": {
            "model_type": "minimax_m3_vl_text",
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 64,
            "dense_intermediate_size": 256,
            "shared_intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-6,
            "use_cache": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "attention_dropout": 0.0,
            "num_experts_per_tok": 2,
            "num_local_experts": 8,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "routed_scaling_factor": 2.0,
            "rotary_dim": 16,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "mlp_layer_types": ["dense"] + ["sparse"] * 3,
            "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 3,
            "index_n_heads": 2,
            "index_head_dim": 32,
            "index_block_size": 16,
            "index_topk_blocks": 2,
            "index_local_blocks": 1,
            "num_mtp_modules": 0,
        },
    }


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_hf_dict_and_json(name):
    cfg = ModelConfig.preset(name)
    d = json.loads(json.dumps(cfg.to_hf_dict()))  # through real JSON: int keys become strings
    assert ModelConfig.from_hf_dict(d) == cfg


def test_default_config_is_full_size_m3_architecture_unquantized():
    cfg = ModelConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts, cfg.vocab_size) == (
        6144,
        60,
        128,
        200064,
    )
    assert [cfg.is_sparse_layer(i) for i in (0, 2, 3, 59)] == [False, False, True, True]
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 59)] == [False, False, True, True]
    assert not cfg.quantization.is_quantized and cfg.kv_cache_dtype == "bf16"
    m3 = ModelConfig.preset("m3")
    assert dataclasses.replace(m3, quantization=QuantConfig(), kv_cache_dtype="bf16") == cfg


def test_presets_m3_and_flash_differ_only_in_quantization_and_kv():
    m3, fl = ModelConfig.preset("m3"), ModelConfig.preset("m3.1-flash")
    assert m3.kv_cache_dtype == "fp8" and fl.kv_cache_dtype == "nvfp4"
    assert m3.quantization.routed_experts == "mxfp8" and m3.quantization.attention == "bf16"
    assert fl.quantization.routed_experts == "nvfp4"
    assert {fl.quantization.attention, fl.quantization.dense_mlp, fl.quantization.shared_experts} == {"mxfp8"}
    assert dataclasses.replace(fl, quantization=m3.quantization, kv_cache_dtype="fp8") == m3


def test_small_and_tiny_presets_have_target_sizes_and_m3_structure():
    tiny, small = ModelConfig.preset("tiny"), ModelConfig.preset("small")
    assert 1e6 <= num_parameters(tiny) <= 4e6
    assert 150e6 <= num_parameters(small) <= 400e6
    for c in (tiny, small):
        assert c.layer_types[0] == "full_attention" and c.mlp_layer_types[0] == "dense"
        assert c.layer_types[-1] == "minimax_m3_sparse" and c.mlp_layer_types[-1] == "sparse"
        assert c.index_n_heads == c.num_key_value_heads and c.quantization.routed_experts == "nvfp4"
    assert (tiny.head_dim, tiny.rotary_dim, tiny.index_block_size, tiny.index_topk_blocks) == (32, 16, 16, 2)
    assert tiny.kv_cache_dtype == "bf16"


def test_unknown_preset_error_lists_valid_presets():
    with pytest.raises(ValueError, match=r"unknown preset 'm4'.*'m3'.*'m3.1-flash'.*'small'.*'tiny'"):
        ModelConfig.preset("m4")


def tiny_kwargs(**over):
    base = dataclasses.asdict(ModelConfig.preset("tiny"))
    base.update(over)
    return base


@pytest.mark.parametrize(
    "over, match",
    [
        ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers=4"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, r"mlp_layer_types\[1\]='moe'"),
        ({"num_attention_heads": 5}, "must be a multiple of num_key_value_heads"),
        ({"index_n_heads": 4}, "index_n_heads=4 must equal num_key_value_heads=2"),
        ({"rotary_dim": 15}, "rotary_dim=15 must be even"),
        ({"rotary_dim": 64}, "rotary_dim=64 .* <= head_dim=32"),
        (
            {"index_topk_blocks": 1, "index_init_blocks": 1},
            "index_topk_blocks=1 must be >= index_local_blocks",
        ),
        ({"moe_intermediate_size": 72}, r"routed_experts='nvfp4' needs moe_intermediate_size % 16 == 0"),
        ({"kv_cache_dtype": "int8"}, r"kv_cache_dtype='int8' is invalid.*'nvfp4'"),
        ({"kv_cache_dtype_overrides": {4: "bf16"}}, r"kv_cache_dtype_overrides key 4 must be .* \[0, 3\]"),
        ({"kv_cache_dtype_overrides": {0: "fp4"}}, r"kv_cache_dtype_overrides\[0\]='fp4' is invalid"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
    ],
)
def test_invalid_config_raises_naming_the_field(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**tiny_kwargs(**over))


def test_quant_validation_errors_name_group_and_fix():
    with pytest.raises(ValueError, match=r"QuantConfig.attention='int4' is invalid"):
        QuantConfig(attention="int4")
    with pytest.raises(ValueError, match=r"attention='mxfp8' needs hidden_size % 32 == 0"):
        ModelConfig(**tiny_kwargs(hidden_size=144, quantization=QuantConfig(attention="mxfp8")))
    q = QuantConfig(routed_experts="nvfp4", exclude_modules=["model.layers.2.block_sparse_moe"])
    with pytest.raises(ValueError, match=r"keeps model\.layers\.2.block_sparse_moe.experts.0.w1 in bf16"):
        ModelConfig(**tiny_kwargs(quantization=q))
    all_sparse = {"mlp_layer_types": ["sparse"] * 4, "quantization": QuantConfig(dense_mlp="nvfp4")}
    with pytest.raises(ValueError, match="dense_mlp='nvfp4' but no layer has that part"):
        ModelConfig(**tiny_kwargs(**all_sparse))


def test_layer_helpers_and_module_dtype():
    cfg = dataclasses.replace(
        ModelConfig.preset("m3.1-flash"), kv_cache_dtype_overrides={0: "bf16", 1: "fp8"}
    )
    assert [cfg.kv_dtype_for_layer(i) for i in (0, 1, 2, 59)] == ["bf16", "fp8", "nvfp4", "nvfp4"]
    with pytest.raises(IndexError):
        cfg.kv_dtype_for_layer(60)
    assert cfg.module_dtype("model.layers.7.block_sparse_moe.experts.77.w2") == "nvfp4"
    assert cfg.module_dtype("model.layers.7.block_sparse_moe.shared_experts.up_proj") == "mxfp8"
    assert cfg.module_dtype("model.layers.1.mlp.down_proj") == "mxfp8"
    assert cfg.module_dtype("model.layers.7.self_attn.index_q_proj") == "mxfp8"
    assert cfg.module_dtype("model.layers.7.block_sparse_moe.gate") == "bf16"
    assert cfg.module_dtype("lm_head") == "bf16"
    assert ModelConfig.preset("m3").module_dtype("model.layers.0.self_attn.q_proj") == "bf16"


def test_legacy_m3_text_style_loads_as_m3_preset():
    cfg = ModelConfig.from_hf_dict(legacy_m3_text_dict())
    want = ModelConfig.preset("m3")
    assert cfg.quantization.exclude_modules == legacy_m3_text_dict()["quantization_config"]["ignore"]
    assert dataclasses.replace(cfg, quantization=want.quantization) == want
    assert (cfg.quantization.routed_experts, cfg.quantization.attention, cfg.kv_cache_dtype) == (
        "mxfp8",
        "bf16",
        "fp8",
    )
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_vl_style_with_mixed_precision_loads_and_round_trips(tmp_path):
    d = vl_tiny_dict()
    cfg = ModelConfig.from_hf_dict(d)
    want_q = QuantConfig(
        routed_experts="nvfp4",
        shared_experts="mxfp8",
        dense_mlp="mxfp8",
        attention="mxfp8",
        exclude_modules=d["quantization_config"]["ignore"],
    )
    assert cfg.quantization == want_q and cfg.kv_cache_dtype == "nvfp4"
    assert cfg.vision_config == d["vision_config"]
    assert cfg.vl_extras == {
        "image_token_index": 200025,
        "video_token_index": 200026,
        "projector_hidden_size": 128,
    }
    tiny = ModelConfig.preset("tiny")
    strip = dict(quantization=tiny.quantization, kv_cache_dtype="bf16", vision_config=None, vl_extras={})
    assert dataclasses.replace(cfg, **strip) == tiny
    out = cfg.to_hf_dict()
    assert out["model_type"] == "minimax_m3_vl" and out["vision_config"] == d["vision_config"]
    assert ModelConfig.from_hf_dict(out) == cfg
    cfg.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == cfg


def test_save_pretrained_writes_modelopt_file_that_loads_alone(tmp_path):
    cfg = ModelConfig.preset("m3.1-flash")
    cfg.save_pretrained(tmp_path)
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert hq["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    assert hq["quantization"]["quantized_layers"]["model.layers.3.block_sparse_moe.experts"] == {
        "quant_algo": "W4A16_NVFP4",
        "group_size": 16,
    }
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    d = json.loads((tmp_path / "config.json").read_text())
    del d["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_pretrained(tmp_path) == cfg  # quantization from hf_quant_config.json alone


def test_save_pretrained_unquantized_writes_no_quant_file(tmp_path):
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig())
    cfg.save_pretrained(tmp_path)
    assert not (tmp_path / "hf_quant_config.json").exists()
    assert ModelConfig.from_pretrained(tmp_path) == cfg


def test_stale_hf_quant_config_disagreeing_with_config_json_fails(tmp_path):
    ModelConfig.preset("tiny").save_pretrained(tmp_path)
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    hq["quantization"]["quant_algo"] = "FP8"
    hq["quantization"].pop("group_size")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(ValueError, match=r"disagrees with config\.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_unknown_key_error_lists_valid_keys_but_known_hf_keys_are_ignored():
    d = ModelConfig.preset("tiny").to_hf_dict()
    text = d["text_config"]  # quantized: the released wrapper layout
    text.update({k: None for k in ("initializer_range", "use_cache", "auto_map", "torch_dtype")})
    assert ModelConfig.from_hf_dict(d) == ModelConfig.preset("tiny")
    assert "router_aux_loss_coef" in IGNORED_HF_KEYS
    text["num_expertz"] = 3
    with pytest.raises(
        ValueError, match=r"unknown config keys \['num_expertz'\]; valid keys: .*'num_local_experts'"
    ):
        ModelConfig.from_hf_dict(d)
    v = vl_tiny_dict()
    v["image_magic"] = 1
    with pytest.raises(
        ValueError, match=r"unknown top-level config keys \['image_magic'\]; valid keys: .*text_config"
    ):
        ModelConfig.from_hf_dict(v)
    s = legacy_m3_text_dict()
    s["sparse_attention_config"]["sparse_magic"] = 1
    with pytest.raises(ValueError, match=r"unknown sparse_attention_config keys \['sparse_magic'\]"):
        ModelConfig.from_hf_dict(s)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(index_topk_blocks=8), "disagree on index_topk_blocks"),
        (lambda d: d.update(partial_rotary_factor=0.25), "disagree on rotary_dim"),
        (lambda d: d.update(use_gemma_norm=False), "use_gemma_norm=False is not supported"),
        (lambda d: d.update(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (lambda d: d.update(rope_parameters={"rope_type": "yarn", "factor": 4}), "only rope_type 'default'"),
        (lambda d: d["sparse_attention_config"].update(sparse_score_type="mean"), "sparse_score_type='mean'"),
        (
            lambda d: d["quantization_config"].update(quant_algo="INT4_AWQ"),
            r"unsupported quant_algo 'INT4_AWQ'",
        ),
        (lambda d: d["quantization_config"].update(quant_method="gptq"), "only ModelOpt"),
        (lambda d: d["quantization_config"].update(group_size=16), "MXFP8 needs group_size 32"),
        (lambda d: d["quantization_config"].update(kv_cache_quant_algo="INT8"), "kv_cache_quant_algo='INT8'"),
        (
            lambda d: d["quantization_config"].update(ignore=["model.layers.5.self_attn"]),
            "only part of attention",
        ),
        (lambda d: d.update(kv_cache_dtype="nvfp4"), "disagrees with the quantization_config"),
    ],
)
def test_bad_legacy_dict_fails_clearly(mutate, match):
    d = legacy_m3_text_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_mixed_precision_with_two_schemes_in_one_group_fails():
    d = vl_tiny_dict()
    d["quantization_config"]["quantized_layers"]["model.layers.2.self_attn.q_proj"] = {"quant_algo": "FP8"}
    with pytest.raises(ValueError, match=r"mixes .* within attention"):
        ModelConfig.from_hf_dict(d)


def test_single_algo_checkpoint_exclude_list_maps_to_groups():
    d = ModelConfig.preset("tiny").to_hf_dict()
    d["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", "*self_attn*", "*.mlp.*"],
    }
    q = ModelConfig.from_hf_dict(d).quantization
    assert (q.routed_experts, q.shared_experts, q.dense_mlp, q.attention) == (
        "nvfp4",
        "nvfp4",
        "bf16",
        "bf16",
    )
    assert q.nvfp4_act_quant  # "NVFP4" is W4A4


def test_transformers_port_config_dict_loads_and_matches_our_legacy_reading():
    """The installed transformers port (style b) turns legacy kwargs into flat keys; its to_dict()
    must load (every key known or ignored) into the same config as our own legacy parsing."""
    port = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")
    tiny = ModelConfig.preset("tiny")
    text = tiny.to_hf_dict()["text_config"]
    legacy = {k: v for k, v in text.items() if k not in ("layer_types", "mlp_layer_types")}
    legacy = {k: v for k, v in legacy.items() if not k.startswith("index_") and k != "quantization_config"}
    keep = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "dense_intermediate_size",
        "shared_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "num_experts_per_tok",
        "num_local_experts",
        "rotary_dim",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sparse_attention_config",
        "moe_layer_freq",
    ]
    text = port.MiniMaxM3VLTextConfig(
        **{k: legacy[k] for k in keep},
        rope_parameters={"rope_type": "default", "rope_theta": tiny.rope_theta},
    )
    d = port.MiniMaxM3VLConfig(text_config=text.to_dict()).to_dict()
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.vision_config["patch_size"] == 14 and cfg.vl_extras["image_token_index"] == 200025
    arch = dict(quantization=QuantConfig(), vision_config=None, vl_extras={}, num_mtp_modules=1)
    assert dataclasses.replace(cfg, **arch) == dataclasses.replace(ModelConfig.from_hf_dict(legacy), **arch)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_replacing_a_bf16_group_with_a_quantized_scheme_keeps_config_valid():
    tiny = ModelConfig.preset("tiny")
    cfg = dataclasses.replace(tiny, quantization=dataclasses.replace(tiny.quantization, attention="mxfp8"))
    assert cfg.module_dtype("model.layers.0.self_attn.o_proj") == "mxfp8"
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert ModelConfig.preset("m3").to_hf_dict()["quantization_config"]["ignore"][:2] == [
        "lm_head",
        "model.embed_tokens",
    ]


def test_released_vl_config_parses_its_vision_part_and_round_trips_it():
    from model.vision.config import VISION_TOP_LEVEL_KEYS, VisionConfig

    v, top = VisionConfig.preset("m3").to_hf_dict()
    assert set(top) <= VISION_TOP_LEVEL_KEYS
    text = ModelConfig.preset("m3").to_hf_dict()["text_config"]
    d = {"model_type": "minimax_m3_vl", "text_config": text, "vision_config": v, **top}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.vision == VisionConfig.preset("m3")
    out = cfg.to_hf_dict()
    assert out["vision_config"] == v and all(out[k] == top[k] for k in top)
    assert ModelConfig.preset("tiny").vision is None
    bad = ModelConfig.from_hf_dict({**d, "vision_config": {**v, "hidden_size": -1}})
    with pytest.raises(ValueError, match="hidden_size"):
        _ = bad.vision
