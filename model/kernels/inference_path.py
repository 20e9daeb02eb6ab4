"""Whether an op takes its fused Triton inference launch: the one rule every engine-path kernel uses.

Why one place: norms, RoPE, the MoE router, swigluoai and the MoE combine all switch on it, and
kernels must not import layers. Invariant: True only in inference mode, outside torch.compile
tracing (Inductor fuses the torch ops itself), where Triton runs for the tensor (CUDA, or the CPU
under TRITON_INTERPRET=1); Triton is imported only when the first two hold.
"""

import torch


def triton_inference_path(x: torch.Tensor) -> bool:
    """Inference mode, torch.compile not tracing, and Triton available for x (`triton_available`)."""
    if not torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
        return False
    from model.kernels.triton_common import triton_available  # imports Triton: only on this path

    return triton_available(x)
