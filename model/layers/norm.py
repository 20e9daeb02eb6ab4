"""Gemma-style RMSNorm, the only normalisation in the MiniMax-M3 family.

`y = x * rsqrt(mean(x^2) + eps) * (1 + w)` with `w` initialised to 0, so a freshly built norm is
the identity scaling. It is used on the residual stream (hidden_size) and per head on q, k,
index_q and index_k (over head_dim).

Invariant: the arithmetic runs in fp32 whatever the input dtype and the result is cast back to
the input dtype at the very end ((x * w).to(dtype), not x.to(dtype) * w), matching the
reference implementations so bf16 checkpoints reproduce bit-for-bit. In inference mode on CUDA
(the rollout engines; the learner's no-grad log-prob passes keep the torch path, so its old and new
log-probs share one arithmetic) and outside torch.compile, the same arithmetic runs as one Triton
launch (`model.kernels.triton_norm`: another summation order, so a few fp32 ulps).
"""

import torch
from torch import nn

from model.kernels.inference_path import triton_inference_path


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim of `x`; `weight` has shape [x.shape[-1]]."""
    if triton_inference_path(x):
        from model.kernels.triton_norm import rms_norm_supported, rms_norm_triton

        if rms_norm_supported(x):
            return rms_norm_triton(x, weight, eps)
    x_f32 = x.float()
    inv_rms = torch.rsqrt(x_f32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x_f32 * inv_rms * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + y, rms_norm(x + y, weight, eps)): a residual add and the norm after it (one Triton launch
    on the inference path; the same values as the two ops)."""
    if triton_inference_path(x):
        from model.kernels.triton_norm import add_rms_norm_supported, add_rms_norm_triton

        if add_rms_norm_supported(x, y):
            return add_rms_norm_triton(x, y, weight, eps)
    total = x + y
    return total, rms_norm(total, weight, eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm with a zero-initialised `weight` (the checkpoint stores w, not 1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm dim must be positive, got {dim}")
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, self(x + y)) (`add_rms_norm`)."""
        return add_rms_norm(x, y, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
