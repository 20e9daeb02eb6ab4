"""Configuration of the M3 family's vision side: tower, projector, image tokens, preprocessing, limits.

What: `VisionConfig`, one validated dataclass for everything that turns an image into text-width
embeddings at placeholder positions: the CLIP-style tower (`vision_config` of a `minimax_m3_vl`
config.json), the two projector MLPs, the placeholder token ids, the preprocessing constants and the
request limits. `from_hf_dict` / `to_hf_dict` read and write the HF split (the `vision_config` dict
plus the multimodal keys at the top level of config.json); both spellings of the released config
(`img_token_compression_config`, `rope_theta`) and of transformers' port (flat, `rope_parameters`)
are read.

Invariants: `from_hf_dict(*cfg.to_hf_dict(), text_hidden_size=cfg.text_hidden_size) == cfg`; an
unknown key raises, naming it; keys for variants not implemented are accepted only at the released value.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# Facts (transformers 5.19 `minimax_m3_vl`, vLLM's `minimax_m3` vision tower, the released config):
# - tower: hidden 1280, 32 layers, 16 heads (head_dim 80), MLP 5120 (exact-erf GELU), LayerNorm eps
#   1e-5; Conv3d patch embedding (no bias) over 2 frames x 14 x 14 x 3 channels; 3D RoPE (theta 1e4)
#   on the first 3 * 26 = 78 of 80 head dims; attention per image, no causal mask;
# - projector: per patch 1280 -> 6144 -> GELU -> 6144; then 2x2 neighbouring patches concatenated
#   (24576) -> 6144 -> GELU -> 6144, one token per merged group; all with bias;
# - tokens: image placeholder 200025, video 200026; an image is written as `]<]start of image[>[`
#   (200029) + n x `]<]image[>[` + `]<]end of image[>[` (200030);
# - preprocessing: resize so both sides are multiples of 28 (patch x merge) with the area kept in
#   [3136, 451584] (at most 576 tokens per image), bicubic; x / 255, CLIP mean/std normalisation.

VisionWeightDtype = Literal["bf16", "mxfp8", "nvfp4"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Keys this module reads at the top level of a `minimax_m3_vl` config.json (besides text_config /
# vision_config / quantization_config). ModelConfig must route these here instead of rejecting them.
VISION_TOP_LEVEL_KEYS = frozenset(
    {
        "image_token_index", "video_token_index", "image_token_id", "video_token_id",
        "vision_start_token_id", "vision_end_token_id", "projector_hidden_size", "projector_hidden_act",
        "multimodal_projector_bias", "img_token_compression_config", "merged_hidden_size",
        "image_seq_length", "process_image_mode", "vision_feature_layer",
        "vision_feature_select_strategy",
    }
)  # fmt: skip

# Values the released model uses for switches this module does not make configurable.
_PINNED = {
    "hidden_act": "gelu",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "patch_merge_bias": True,
    "position_embedding_type": "rope",
    "rope_mode": "3d",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "process_image_mode": "dynamic_res",
    "image_token_compression_method": "patch_merge",
    "rope_type": "axial",
}
# Bookkeeping / training keys that carry nothing the forward pass uses.
_IGNORED = frozenset(
    {
        "model_type", "architectures", "torch_dtype", "dtype", "transformers_version",
        "initializer_range", "initializer_factor", "attention_dropout", "dropout", "projection_dim",
        "_name_or_path", "name_or_path", "return_dict", "output_attentions", "output_hidden_states",
        "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
        "problem_type", "_attn_implementation", "image_seq_length", "merged_hidden_size",
    }
)  # fmt: skip
_TOWER_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
    "patch_size", "temporal_patch_size", "spatial_merge_size", "layer_norm_eps", "rope_theta",
    "image_size", "vision_segment_max_frames",
)  # fmt: skip
# Project fields that are not part of upstream's schema; written into vision_config so a saved
# config reloads to the same object.
_PROJECT_KEYS = (
    "min_pixels", "max_pixels", "image_mean", "image_std", "max_images_per_request",
    "max_image_bytes", "max_source_pixels", "weight_dtype",
)  # fmt: skip


@dataclass
class VisionConfig:
    # ---- tower (vision_config)
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    image_size: int = 2016  # carried for round trips; resizing is governed by min/max_pixels
    vision_segment_max_frames: int | None = 4  # videos: attention segments of at most this many
    # ---- projector and text side (top level of config.json)
    projector_hidden_size: int = 6144
    text_hidden_size: int = 6144  # the language model's hidden_size (= ModelConfig.hidden_size)
    image_token_id: int = 200025
    video_token_id: int = 200026
    vision_start_token_id: int | None = 200029  # None: placeholders are not bracketed
    vision_end_token_id: int | None = 200030
    # ---- preprocessing (upstream image processor)
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 576 * 28 * 28  # 451584: at most 576 image tokens
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    # ---- request limits (this project's policy, enforced before any decoding work)
    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024  # encoded bytes of one image
    max_source_pixels: int = 40_000_000  # width x height as the file declares it (decompression bombs)
    # ---- storage of the tower / projector linear weights (never NVFP4 unless set here)
    weight_dtype: VisionWeightDtype = "bf16"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                     "image_size", "projector_hidden_size", "text_hidden_size", "min_pixels",
                     "max_pixels", "max_images_per_request", "max_image_bytes",
                     "max_source_pixels"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"VisionConfig.{name} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"VisionConfig.hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.rope_axis_dim < 2:
            raise ValueError(
                f"VisionConfig: head_dim={self.head_dim} leaves no rotary pair per axis (3D RoPE needs "
                "head_dim >= 6)"
            )
        if self.vision_segment_max_frames is not None and self.vision_segment_max_frames <= 0:
            raise ValueError(
                f"VisionConfig.vision_segment_max_frames must be None or > 0, got "
                f"{self.vision_segment_max_frames}"
            )
        if not self.layer_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("VisionConfig.layer_norm_eps and rope_theta must be > 0")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"VisionConfig.min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")
        if self.max_pixels < self.resize_factor**2:
            raise ValueError(
                f"VisionConfig.max_pixels={self.max_pixels} is below one merged patch "
                f"({self.resize_factor}^2 = {self.resize_factor**2} pixels)"
            )
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        if len(self.image_mean) != self.num_channels or len(self.image_std) != self.num_channels:
            raise ValueError(
                f"VisionConfig.image_mean / image_std need one value per channel ({self.num_channels}), "
                f"got {len(self.image_mean)} / {len(self.image_std)}"
            )
        if not all(s > 0 for s in self.image_std):
            raise ValueError(f"VisionConfig.image_std must be > 0, got {self.image_std}")
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]
        given = [i for i in ids if i is not None]
        if any(not isinstance(i, int) or i < 0 for i in given) or len(set(given)) != len(given):
            raise ValueError(f"VisionConfig token ids must be distinct non-negative ints, got {ids}")
        if (self.vision_start_token_id is None) != (self.vision_end_token_id is None):
            raise ValueError(
                "VisionConfig: set both vision_start_token_id and vision_end_token_id, or neither"
            )
        if self.weight_dtype not in get_args(VisionWeightDtype):
            raise ValueError(
                f"VisionConfig.weight_dtype={self.weight_dtype!r}; choose one of "
                f"{list(get_args(VisionWeightDtype))}"
            )
        mult = {"bf16": 1, "mxfp8": 32, "nvfp4": 16}[self.weight_dtype]
        for name, k in self.linear_in_features().items():
            if k % mult:
                raise ValueError(
                    f"VisionConfig.weight_dtype={self.weight_dtype!r} needs every linear input width to "
                    f"be a multiple of {mult}; {name} has {k}. Keep the vision weights in bf16"
                )

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_axis_dim(self) -> int:
        """Rotated dims per axis (t, h, w): the largest even number <= head_dim / 3."""
        return 2 * ((self.head_dim // 3) // 2)

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head (78 of 80 for M3); the rest pass through."""
        return 3 * self.rope_axis_dim

    @property
    def patch_dim(self) -> int:
        """Values per patch row of `pixel_values`: channels x frames x patch x patch (1176)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches fused into one image token (2 x 2)."""
        return self.spatial_merge_size**2

    @property
    def resize_factor(self) -> int:
        """Both resized sides are multiples of this (28)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def merged_hidden_size(self) -> int:
        return self.text_hidden_size * self.merge_unit

    @property
    def max_tokens_per_image(self) -> int:
        return self.max_pixels // self.resize_factor**2

    def linear_in_features(self) -> dict[str, int]:
        """Input width of every linear kind (the K dim a block-scaled format divides)."""
        return {
            "self_attn.*_proj": self.hidden_size,
            "mlp.fc1": self.hidden_size,
            "mlp.fc2": self.intermediate_size,
            "multi_modal_projector.linear_1": self.hidden_size,
            "multi_modal_projector.linear_2": self.projector_hidden_size,
            "patch_merge_mlp.linear_1": self.merged_hidden_size,
            "patch_merge_mlp.linear_2": self.projector_hidden_size,
        }

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> VisionConfig:
        """Presets. m3: the released tower (any M3-family text preset). tiny: the same structure at
        CPU-test size for ModelConfig.preset("tiny") (text hidden 128, vocab 512). Its placeholder
        ids 500-503 lie above common/tokenizer.py's ByteTokenizer range (0-258) and below the tiny
        vocab, so byte text can never produce them and the embedding table has rows for them."""
        if name == "m3":
            return cls()
        if name == "tiny":
            # head_dim 16: 4 rotated dims per axis, 12 of 16 rotated, 4 pass through (like 78 of 80).
            # Patch 4 x merge 2 -> sides are multiples of 8; at most 64 x 64 pixels = 64 tokens.
            return cls(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                patch_size=4, image_size=64, projector_hidden_size=128, text_hidden_size=128,
                image_token_id=500, video_token_id=501, vision_start_token_id=502,
                vision_end_token_id=503, min_pixels=4 * 8 * 8, max_pixels=64 * 64,
                max_images_per_request=4, max_image_bytes=1 << 20, max_source_pixels=1 << 20,
            )  # fmt: skip
        raise ValueError(f"unknown vision preset {name!r}; valid presets: ['m3', 'tiny']")

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(
        cls, vision_config: Mapping[str, Any], top: Mapping[str, Any] | None = None, *, text_hidden_size: int
    ) -> VisionConfig:
        """Build from a `vision_config` dict and the top-level multimodal keys of the same
        config.json (see VISION_TOP_LEVEL_KEYS); `text_hidden_size` is text_config's hidden_size."""
        v = copy.deepcopy(dict(vision_config))
        t = copy.deepcopy(dict(top or {}))
        unknown_top = sorted(k for k in t if k not in VISION_TOP_LEVEL_KEYS)
        if unknown_top:
            raise ValueError(
                f"unknown top-level multimodal keys {unknown_top}; known: {sorted(VISION_TOP_LEVEL_KEYS)}"
            )
        kw: dict[str, Any] = {"text_hidden_size": text_hidden_size}

        def put(field: str, value: Any, src: str) -> None:
            if field in kw and kw[field] != value:
                raise ValueError(f"{src}={value!r} disagrees with an earlier value {kw[field]!r} for {field}")
            kw[field] = value

        def pin(key: str, value: Any, src: str) -> None:
            if value != _PINNED[key]:
                raise ValueError(
                    f"{src}={value!r} is not supported (only the released model's {_PINNED[key]!r} is "
                    "implemented); fix the config or extend model/vision"
                )

        # Merge / temporal sizes: flat (transformers' port) or nested (released config), either level.
        for where, d in (("vision_config", v), ("top level", t)):
            comp = d.pop("img_token_compression_config", None) or {}
            for key, value in comp.items():
                src = f"{where}.img_token_compression_config.{key}"
                if key in ("spatial_merge_size", "temporal_patch_size"):
                    put(key, value, src)
                elif key == "image_token_compression_method":
                    pin(key, value, src)
                else:
                    raise ValueError(f"unknown key {src}; known: spatial_merge_size, temporal_patch_size")
        rope = v.pop("rope_parameters", None) or {}
        for key, value in rope.items():
            if key == "rope_theta":
                put("rope_theta", float(value), "vision_config.rope_parameters.rope_theta")
            elif key == "rope_type":
                pin("rope_type", value, "vision_config.rope_parameters.rope_type")
            else:
                raise ValueError(f"unknown key vision_config.rope_parameters.{key}")
        for key, value in v.items():
            src = f"vision_config.{key}"
            if key in _TOWER_KEYS or key in _PROJECT_KEYS:
                put(key, float(value) if key == "rope_theta" else value, src)
            elif key in _PINNED:
                pin(key, value, src)
            elif key not in _IGNORED:
                known = sorted(set(_TOWER_KEYS) | set(_PROJECT_KEYS) | set(_PINNED))
                raise ValueError(f"unknown key {src}; known: {known}")
        aliases = {"image_token_index": "image_token_id", "video_token_index": "video_token_id"}
        for key, value in t.items():
            if key in aliases or key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id", "projector_hidden_size"):  # fmt: skip
                put(aliases.get(key, key), value, key)
            elif key in _PINNED:
                pin(key, value, key)
        # A written merged_hidden_size must agree with what the projector derives.
        cfg = cls(**kw)
        merged = t.get("merged_hidden_size")
        if merged is not None and merged != cfg.merged_hidden_size:
            raise ValueError(
                f"merged_hidden_size={merged} disagrees with text hidden {text_hidden_size} x "
                f"{cfg.merge_unit} merged patches = {cfg.merged_hidden_size}"
            )
        return cfg

    def to_hf_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(vision_config dict, top-level keys): transformers' flat spelling plus this project's
        preprocessing / limit / storage fields, so a saved config reloads to an equal object."""
        vision: dict[str, Any] = {
            "model_type": "minimax_m3_vl_vision",
            **{k: getattr(self, k) for k in _TOWER_KEYS},
            "hidden_act": "gelu",
            **{k: copy.deepcopy(getattr(self, k)) for k in _PROJECT_KEYS},
        }
        vision["image_mean"] = list(self.image_mean)
        vision["image_std"] = list(self.image_std)
        top: dict[str, Any] = {
            "image_token_index": self.image_token_id,
            "video_token_index": self.video_token_id,
            "projector_hidden_size": self.projector_hidden_size,
            "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True,
            "merged_hidden_size": self.merged_hidden_size,
        }
        # Not upstream keys (upstream's processor looks the bracket tokens up in the tokenizer), but
        # written always so that None (no brackets) survives a round trip.
        top["vision_start_token_id"] = self.vision_start_token_id
        top["vision_end_token_id"] = self.vision_end_token_id
        return vision, top

    def replace(self, **changes: Any) -> VisionConfig:
        return dataclasses.replace(self, **changes)
