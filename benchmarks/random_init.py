"""Random weights drawn on the model's own device, for benchmarks at M3 width.

Why: `MiniMaxM3ForCausalLM.init_weights` draws on the CPU (so the device never changes the weights,
which tests rely on); at M3.1-Flash width that is minutes per layer (128 experts x 3 x 19M values).
Benchmarks that only need realistic shapes and value ranges draw here instead, on the GPU, seeded:
the same generator seed gives the same weights on every rank of a multi-GPU run.
"""

from __future__ import annotations

import torch

from model.layers.moe import MoE
from model.modeling import MiniMaxM3ForCausalLM


@torch.no_grad()
def random_nvfp4_bank_(moe: MoE, gen: torch.Generator) -> None:
    """Random NVFP4 codes and block scales for `moe`'s routed bank, generated on the bank's device,
    and N(0, 0.02^2) for the layer's other parameters (router, shared expert)."""
    bank = moe.experts
    for proj in ("w1", "w2", "w3"):
        w = getattr(bank, f"{proj}_weight")
        for e in range(bank.num_experts):
            w[e] = torch.randint(0, 256, w[e].shape, generator=gen, device=w.device, dtype=torch.uint8)
            s = getattr(bank, f"{proj}_weight_scale")[e]
            s.copy_((torch.rand(s.shape, generator=gen, device=w.device) * 2 + 0.5).to(torch.float8_e4m3fn))
        getattr(bank, f"{proj}_weight_scale_2").fill_(0.01)
    for p in moe.parameters():
        p.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def random_model_(model: MiniMaxM3ForCausalLM, gen: torch.Generator) -> None:
    """Every parameter N(0, 0.02^2) (norm gains included: the model's norms scale by 1 + w), NVFP4
    routed banks as `random_nvfp4_bank_`, router correction biases 0."""
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            if moe.experts.fmt == "nvfp4":
                random_nvfp4_bank_(moe, gen)
            moe.e_score_correction_bias.zero_()
