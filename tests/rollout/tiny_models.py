"""The random tiny model and prompts the engine tests share."""

import dataclasses

import torch

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM


def build(seed: int = 0, **overrides) -> MiniMaxM3ForCausalLM:
    """The `tiny` preset (fields overridden), random weights of std 0.05, in eval mode."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), **overrides)
    return MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=seed).eval()


def prompts(lengths, seed=0) -> list[tuple[int, ...]]:
    """Random prompts of the given lengths over the byte-tokenizer-free id range [3, 512)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 512, (n,), generator=g).tolist()) for n in lengths]
