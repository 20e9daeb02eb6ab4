"""Partial NeoX-style rotary position embedding (RoPE).

MiniMax-M3 rotates only the first `rotary_dim` channels of every head (64 of 128) and passes
the rest through. NeoX pairing: channel i is rotated with channel i + rotary_dim/2 (the two
halves of the rotary slice), not with its neighbour i + 1 (GPT-J style). The same cos/sin are
applied to q, k, index_q and index_k.

Invariants:
- cos/sin are computed in fp32 from integer positions of any shape: angle = pos * theta^(-2i/r),
  i < r/2. fp32 represents every position up to 2^24 exactly (max_position_embeddings is 2^19).
- `apply_rope` rotates in fp32 and casts back to the input dtype.
- `norm_rope` = apply_rope(norm(x)); where the norm takes its Triton launch (inference on CUDA) both
  run as one (`model.kernels.triton_norm.rms_norm_rope_triton`, the same roundings up to fp32 order).

Legend: R = rotary_dim // 2 (number of frequencies), C = head dim.
"""

import torch

from model.kernels.inference_path import triton_inference_path
from model.layers.norm import RMSNorm


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32, shape [*positions.shape, rotary_dim // 2], for integer `positions`."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    exponent_R = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim
    inv_freq_R = 1.0 / (theta**exponent_R)
    angle = positions.to(torch.float32)[..., None] * inv_freq_R
    return torch.cos(angle), torch.sin(angle)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2R channels of every head of `x` [..., heads, C].

    `cos`/`sin` [..., R] carry the leading dims of `x` without the heads dim (they broadcast over
    heads), e.g. x [B, S, H, C] with cos [B, S, R]. Channels 2R..C-1 pass through unchanged.
    """
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_dim {2 * half} exceeds the head dim {x.shape[-1]}")
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    x_f32 = x.float()
    x1 = x_f32[..., :half]
    x2 = x_f32[..., half : 2 * half]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_f32[..., 2 * half :]], dim=-1)
    return rotated.to(x.dtype)


def norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(norm(x), cos, sin)`: one Triton launch for x [T, H, C] on the engines' path."""
    if triton_inference_path(x):
        from model.kernels.triton_norm import rms_norm_rope_supported, rms_norm_rope_triton

        if rms_norm_rope_supported(x, cos):
            return rms_norm_rope_triton(x, norm.weight, norm.eps, cos, sin)
    return apply_rope(norm(x), cos, sin)
