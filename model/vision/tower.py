"""The M3 family's vision tower and projector, and the placement of image features in the text stream.

What: `VisionModel` (patch embedding -> pre-norm -> CLIP encoder layers with 3D RoPE -> projector ->
2x2 patch merge) under the released checkpoint's module names, so loading is a straight copy
(model/vision/weights.py); `image_features(pixel_values, grids)` gives one text-width row per image
token; `merge_image_features` writes them over the placeholder embeddings.

Invariants: attention is bidirectional within one image only (as vLLM's port, via cu_seqlens), so an
image's features do not depend on the batch and can be cached (`encode_images` computes a repeated
image once); every linear is a `VisionLinear`, so the text LoRA never adapts the frozen tower by
accident (the projector takes an adapter only through `apply_projector_lora`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.vision.config import VisionConfig

# Legend: P patches (rows of pixel_values), K patch values (C*T*p*p), D vision hidden, H heads,
# d head dim, E text hidden, N image tokens (P / merge^2), S/B text sequence and batch.
#
# Checkpoint modules: vision_tower.vision_model.{embeddings.patch_embedding, pre_layrnorm,
# encoder.layers.{i}.*}; multi_modal_projector.{linear_1, linear_2} (per patch: vision hidden -> text
# hidden); patch_merge_mlp.{linear_1, linear_2} (per 2x2 group: 4 x text hidden -> text hidden).
# Videos: one segment of at most `vision_segment_max_frames` frames attends together; the
# transformers port runs all images of a call as one sequence, which agrees for a single image only.
# RoPE positions are (frame, patch row, patch column), rows/columns laid out merge-block-major like
# the patch rows; each axis rotates `rope_axis_dim` dims with inv_freq = theta^(-2i/axis_dim); the
# three sets are concatenated and rotated NeoX-style over the first `rotary_dim` dims, in fp32. No
# post-encoder LayerNorm (the release ships none). The patch embedding (a Conv3d, stride = kernel) is
# the equivalent matmul on flattened (channel, frame, y, x) rows. The tower's attention is also
# spelled `self_attn.q_proj`, hence the distinct `VisionLinear` type.

if TYPE_CHECKING:
    from model.vision.preprocess import ProcessedImage

Grid = tuple[int, int, int]


# ------------------------------------------------------------------------------- geometry
def attention_segments(grids: Sequence[Grid], config: VisionConfig) -> list[Grid]:
    """Grids split into attention segments: a video longer than vision_segment_max_frames
    becomes several segments (each with its own frame positions starting at 0)."""
    out: list[Grid] = []
    cap = config.vision_segment_max_frames
    for t, h, w in grids:
        if cap is None or t <= cap:
            out.append((t, h, w))
        else:
            out.extend((min(cap, t - s), h, w) for s in range(0, t, cap))
    return out


def rope_positions(grid: Grid, merge: int, device: torch.device | None = None) -> torch.Tensor:
    """(frame, row, column) of every patch of one segment, merge-block-major: long [P, 3]."""
    t, h, w = grid
    rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
    cols = torch.arange(w, device=device).view(1, w).expand(h, w)

    def block_major(x_hw: torch.Tensor) -> torch.Tensor:
        return x_hw.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()

    frames = torch.arange(t, device=device).repeat_interleave(h * w)
    return torch.stack([frames, block_major(rows).repeat(t), block_major(cols).repeat(t)], dim=-1)


def rope_cos_sin(positions_P3: torch.Tensor, config: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [P, rotary_dim]: per axis positions x inv_freq, axes concatenated, then the
    half-rotation layout (the same frequencies repeated for both halves)."""
    a = config.rope_axis_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, a, 2, device=positions_P3.device, dtype=torch.float32) / a)
    )
    freqs_P3F = positions_P3.float().unsqueeze(-1) * inv_freq  # [P, 3, a/2]
    freqs_PR = freqs_P3F.flatten(1)  # [P, 3a/2]: t freqs, h freqs, w freqs
    freqs_PR = torch.cat([freqs_PR, freqs_PR], dim=-1)
    return freqs_PR.cos(), freqs_PR.sin()


def apply_rope(x_PHd: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first R dims of every head, computed in fp32; the tail passes through."""
    R = cos_PR.shape[-1]
    rot = x_PHd[..., :R].float()
    x1, x2 = rot[..., : R // 2], rot[..., R // 2 :]
    cos, sin = cos_PR.unsqueeze(1), sin_PR.unsqueeze(1)
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated.to(x_PHd.dtype), x_PHd[..., R:]], dim=-1)


# ------------------------------------------------------------------------------- modules
class VisionLinear(nn.Linear):
    """nn.Linear under its own type, so text-model LoRA targeting skips the tower (module docstring)."""


class PatchEmbedding(nn.Module):
    """Conv3d(C -> D, kernel = stride = (T, p, p), no bias) on pre-cut patches: a matmul with the
    kernel flattened in (channel, frame, y, x) order, exactly the row layout of pixel_values."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        c = config
        self.weight = nn.Parameter(
            torch.empty(c.hidden_size, c.num_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        )

    def forward(self, x_PK: torch.Tensor) -> torch.Tensor:
        return F.linear(x_PK.to(self.weight.dtype), self.weight.flatten(1))


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.patch_embedding = PatchEmbedding(config)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        D = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = VisionLinear(D, D)
        self.k_proj = VisionLinear(D, D)
        self.v_proj = VisionLinear(D, D)
        self.out_proj = VisionLinear(D, D)

    def forward(
        self, x_PD: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor, seg_lens: list[int]
    ) -> torch.Tensor:
        P = x_PD.shape[0]
        q_PHd = apply_rope(self.q_proj(x_PD).view(P, self.num_heads, self.head_dim), cos_PR, sin_PR)
        k_PHd = apply_rope(self.k_proj(x_PD).view(P, self.num_heads, self.head_dim), cos_PR, sin_PR)
        v_PHd = self.v_proj(x_PD).view(P, self.num_heads, self.head_dim)
        outs = []
        # One SDPA call per image/segment: lengths are host ints from the grids (no device sync), and
        # a block-diagonal mask over all images would cost P^2 memory for nothing.
        for q, k, v in zip(q_PHd.split(seg_lens), k_PHd.split(seg_lens), v_PHd.split(seg_lens)):
            o_HSd = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            outs.append(o_HSd.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))
        return self.out_proj(torch.cat(outs) if len(outs) > 1 else outs[0])


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = VisionLinear(config.hidden_size, config.intermediate_size)
        self.fc2 = VisionLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(
        self, x_PD: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor, seg_lens: list[int]
    ) -> torch.Tensor:
        x_PD = x_PD + self.self_attn(self.layer_norm1(x_PD), cos_PR, sin_PR, seg_lens)
        return x_PD + self.mlp(self.layer_norm2(x_PD))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic: CLIP's name
        self.encoder = VisionEncoder(config)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.vision_model = VisionTransformer(config)


class TwoLayerGelu(nn.Module):
    """linear_1 -> exact GELU -> linear_2 (the projector and the patch merger share this shape)."""

    def __init__(self, d_in: int, d_mid: int, d_out: int):
        super().__init__()
        self.linear_1 = VisionLinear(d_in, d_mid)
        self.linear_2 = VisionLinear(d_mid, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VisionModel(nn.Module):
    """Tower + projector + patch merger; parameter names are the released checkpoint's."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        c = config
        self.vision_tower = VisionTower(c)
        self.multi_modal_projector = TwoLayerGelu(c.hidden_size, c.projector_hidden_size, c.text_hidden_size)
        self.patch_merge_mlp = TwoLayerGelu(c.merged_hidden_size, c.projector_hidden_size, c.text_hidden_size)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> VisionModel:
        """Random weights for tests: N(0, std^2) matrices and biases, LayerNorms at (1, 0)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if "lora_" in name:
                continue  # adapters keep their own init (B = 0: a fresh adapter adds nothing)
            if ".layer_norm" in name or ".pre_layrnorm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def check_inputs(self, pixel_values_PK: torch.Tensor, grids: Sequence[Grid]) -> list[Grid]:
        c = self.config
        grids = [tuple(int(v) for v in g) for g in grids]
        if pixel_values_PK.dim() != 2 or pixel_values_PK.shape[1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {c.patch_dim}] (channels x frames x patch^2), got "
                f"{tuple(pixel_values_PK.shape)}"
            )
        for g in grids:
            if len(g) != 3 or min(g) <= 0 or g[1] % c.spatial_merge_size or g[2] % c.spatial_merge_size:
                raise ValueError(
                    f"grid {g} must be (t, h, w) > 0 with h and w multiples of spatial_merge_size="
                    f"{c.spatial_merge_size}"
                )
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values_PK.shape[0]:
            raise ValueError(
                f"grids {grids} describe {total} patches but pixel_values has {pixel_values_PK.shape[0]}"
            )
        return grids

    def encode(self, pixel_values_PK: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Last encoder hidden states [P, D] (no post-norm: the release has none)."""
        grids = self.check_inputs(pixel_values_PK, grids)
        vm = self.vision_tower.vision_model
        segs = attention_segments(grids, self.config)
        seg_lens = [t * h * w for t, h, w in segs]
        dev = pixel_values_PK.device
        pos_P3 = torch.cat([rope_positions(s, self.config.spatial_merge_size, dev) for s in segs])
        cos_PR, sin_PR = rope_cos_sin(pos_P3, self.config)
        x_PD = vm.pre_layrnorm(vm.embeddings.patch_embedding(pixel_values_PK))
        for layer in vm.encoder.layers:
            x_PD = layer(x_PD, cos_PR, sin_PR, seg_lens)
        return x_PD

    def image_features(self, pixel_values_PK: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Text-width embeddings [N, E] for all images (concatenated in order), N = P / merge^2."""
        h_PE = self.multi_modal_projector(self.encode(pixel_values_PK, grids))
        # Rows are merge-block-major, so each run of merge^2 consecutive rows is one 2x2 group.
        h_NmE = h_PE.reshape(-1, self.config.merged_hidden_size)
        return self.patch_merge_mlp(h_NmE)

    def tokens_per_grid(self, grids: Sequence[Grid]) -> list[int]:
        return [t * h * w // self.config.merge_unit for t, h, w in grids]

    def encode_images(self, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """One [num_tokens_i, E] feature tensor per image, in order. Images are deduplicated by
        (sha256, grid) first, so a GRPO group's repeated image runs through the tower once; all
        distinct images go through one `image_features` call. Gradients flow only when a vision
        parameter requires grad (a projector adapter); the frozen tower runs without autograd."""
        if not images:
            return []
        merge = self.config.merge_unit
        for i, im in enumerate(images):
            t, h, w = im.grid_thw
            if im.num_tokens * merge != t * h * w:
                raise ValueError(
                    f"image {i}: num_tokens={im.num_tokens} does not match grid {im.grid_thw} "
                    f"({t * h * w} patches / {merge} per token); build it with preprocess_image"
                )
        slot: dict[tuple, int] = {}
        unique: list[ProcessedImage] = []
        for im in images:
            key = (im.sha256, tuple(im.grid_thw))
            if key not in slot:
                slot[key] = len(unique)
                unique.append(im)
        w = self.multi_modal_projector.linear_1.weight
        pixels_PK = torch.cat([im.pixel_values for im in unique]).to(device=w.device)
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        with torch.set_grad_enabled(needs_grad):
            feats_NE = self.image_features(pixels_PK, [im.grid_thw for im in unique])
        per_image = feats_NE.split([im.num_tokens for im in unique])
        return [per_image[slot[(im.sha256, tuple(im.grid_thw))]] for im in images]


# ------------------------------------------------------------------------------- text stream
def merge_image_features(
    input_embeds: torch.Tensor, input_ids: torch.Tensor, features_NE: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """Embeddings [..., E] with the rows at `input_ids == image_token_id` replaced, in reading order,
    by `features_NE` (images in the order they appear in the text). Differentiable in both inputs.
    Raises if the number of placeholders differs from the number of feature rows."""
    if input_ids.shape != input_embeds.shape[:-1]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must match input_embeds {tuple(input_embeds.shape)} minus "
            "the hidden dim"
        )
    if features_NE.dim() != 2 or features_NE.shape[1] != input_embeds.shape[-1]:
        raise ValueError(f"features must be [N, {input_embeds.shape[-1]}], got {tuple(features_NE.shape)}")
    mask = input_ids == image_token_id
    # SYNC: once per prefill; a count mismatch would otherwise shift every later image silently.
    n = int(mask.sum())
    if n != features_NE.shape[0]:
        raise ValueError(
            f"{n} image placeholder tokens (id {image_token_id}) but {features_NE.shape[0]} image feature "
            "rows; build the prompt with chat_to_ids_and_images so each image gets its token count"
        )
    return input_embeds.masked_scatter(mask.unsqueeze(-1), features_NE.to(input_embeds.dtype))
