"""Random weights drawn on the model's own device, for benchmarks at M3 width.

Why: `MiniMaxM3ForCausalLM.init_weights` draws on the CPU (so the device never changes the weights,
which tests rely on); at M3.1-Flash width that is minutes per layer (128 experts x 3 x 19M values).
Benchmarks that only need realistic shapes and value ranges draw here instead, on the GPU, seeded:
the same generator seed gives the same weights on every rank of a multi-GPU run.

Routed experts are drawn each from a generator of its own, seeded by (layer, global expert id), so a
rank that builds only its experts (`build_random_model(..., expert_range=)`, an expert-parallel
rank of a model too large for one GPU) holds exactly the rows of the whole model's banks.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.attention import Attention
from model.layers.moe import ExpertBank, MoE
from model.modeling import MiniMaxM3ForCausalLM

EXPERT_SEED_STRIDE = 1_000_003  # per-layer offset of the per-expert seeds (more than any expert count)


@torch.no_grad()
def random_nvfp4_bank_(moe: MoE, gen: torch.Generator, expert_seed: int = 0) -> None:
    """Random NVFP4 codes and block scales for `moe`'s routed bank (expert e of the layer from a
    generator seeded `expert_seed + e`, on the bank's device), and N(0, 0.02^2) from `gen` for the
    layer's other parameters (router, shared expert)."""
    bank = moe.experts
    device = bank.w1_weight.device
    for i in range(bank.num_experts):
        g = torch.Generator(device).manual_seed(expert_seed + bank.first_expert + i)
        for proj in ("w1", "w2", "w3"):
            w = getattr(bank, f"{proj}_weight")[i]
            w.copy_(torch.randint(0, 256, w.shape, generator=g, device=device, dtype=torch.uint8))
            s = getattr(bank, f"{proj}_weight_scale")[i]
            s.copy_((torch.rand(s.shape, generator=g, device=device) * 2 + 0.5).to(torch.float8_e4m3fn))
    for proj in ("w1", "w2", "w3"):
        getattr(bank, f"{proj}_weight_scale_2").fill_(0.01)
    for p in moe.parameters():
        p.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def random_model_(model: MiniMaxM3ForCausalLM, gen: torch.Generator, expert_seed: int = 0) -> None:
    """Every parameter N(0, 0.02^2) (norm gains included: the model's norms scale by 1 + w), NVFP4
    routed banks as `random_nvfp4_bank_` (layer i's experts seeded from expert_seed + i * stride),
    router correction biases 0."""
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            if moe.experts.fmt == "nvfp4":
                random_nvfp4_bank_(moe, gen, expert_seed + i * EXPERT_SEED_STRIDE)
            moe.e_score_correction_bias.zero_()


def build_random_model(
    cfg: ModelConfig, device: torch.device, seed: int = 0, expert_range: tuple[int, int] | None = None
) -> MiniMaxM3ForCausalLM:
    """A random fp32 model allocated directly on `device` (built on the meta device first); with
    `expert_range`, every routed bank holds only experts [lo, hi), equal to those rows of the whole
    model this function builds with the same seed (wrap it with `apply_expert_parallel`)."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg)
    if expert_range is not None:
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                moe.experts = ExpertBank.empty_shard(moe.experts, *expert_range)
    model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, Attention):
            m.reset_kv_scales()  # buffers, not drawn below: garbage after to_empty
    random_model_(model, torch.Generator(device).manual_seed(seed), expert_seed=seed)
    return model.eval()
