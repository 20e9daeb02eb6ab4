"""The DSpark drafter: a few dense decoder layers that draft a block of tokens in one parallel pass over
the target's hidden states, a low-rank Markov head that makes the block's tokens depend on each
other, and a confidence head that predicts their acceptance (docs/FACTS.md, "DSpark speculative
decoding"). `save_drafter` / `load_drafter` keep drafter parameters only, under
`ckpt_dir/dspark/{config.json, model.safetensors}`; the embedding and lm_head are the target's,
frozen.

Invariants: the drafter never changes the target's numbers (verification is lossless whatever it
proposes); `draft` returns the exact distribution each token was drawn from (q for the verifier).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from model.config import ModelConfig
from model.layers.norm import RMSNorm
from model.layers.rope import apply_rope, rope_cos_sin
from rollout.native import sampler

# Legend: B requests, S context tokens, M block-query tokens (A anchors x N), N block size,
# L target layers read, D hidden, H heads, G kv heads, C head dim, V vocab, R Markov rank.
#
# Context: the target's residual stream after `target_layer_ids` (L layers), concatenated per token,
# projected (Linear L*D -> D) and normed; each drafter layer turns it into extra K/V with its own
# k/v projections (k-norm and RoPE at the token's position), stored by the engine in pages keyed like
# the target's KV (rollout/dspark/cache.py). Block pass: N positions (anchor = last verified token,
# then N - 1 learned mask vectors) attend to all the context and, non-causally, to each other; block
# position k - 1 gives the base logits U_k of draft token k through the target's lm_head. Markov
# head: logits_k = U_k + W2(W1[x_{k-1}]), x_0 the anchor, sampled left to right. Confidence head:
# c_k = sigmoid(Linear([h_k ; W1[x_{k-1}]])), trained towards 1 - TV(p_draft, p_target); the
# survival prod_{i<=k} c_i feeds the verify scheduler.

DSPARK_DIR = "dspark"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DrafterDtype = Literal["fp32", "bf16"]
_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class DSparkConfig:
    """Drafter shape. `hidden_size` and `vocab_size` must equal the target's (shared embedding and
    lm_head); `target_layer_ids` index the target's decoder layers whose outputs are read."""

    hidden_size: int
    vocab_size: int
    target_layer_ids: list[int]
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    block_size: int = 6
    markov_rank: int = 64
    rotary_dim: int = 16
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    dtype: DrafterDtype = "fp32"
    metadata: dict = field(default_factory=dict)  # provenance (target fingerprint, training stats)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        for name in ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "block_size", "markov_rank"):  # fmt: skip
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"DSparkConfig.{name} must be an int >= 1, got {v!r}")
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct and non-empty, got {self.target_layer_ids}")
        if min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be >= 0, got {self.target_layer_ids}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )
        if self.dtype not in _TORCH_DTYPE:
            raise ValueError(f"dtype must be one of {list(_TORCH_DTYPE)}, got {self.dtype!r}")

    @classmethod
    def for_target(cls, target: ModelConfig, num_target_layers: int = 3, **overrides) -> DSparkConfig:
        """Defaults sized from the target: `num_target_layers` evenly spaced layers ending at the
        last one, the target's head shape, and its RoPE base."""
        n = target.num_hidden_layers
        k = min(num_target_layers, n)
        ids = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}) if k > 1 else [n - 1]
        base = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=ids,
                    num_heads=target.num_attention_heads, num_kv_heads=target.num_key_value_heads,
                    head_dim=target.head_dim, rotary_dim=min(target.rotary_dim, target.head_dim),
                    rope_theta=min(target.rope_theta, 1e6), intermediate_size=2 * target.hidden_size,
                    rms_norm_eps=target.rms_norm_eps)  # fmt: skip
        base.update(overrides)
        return cls(**base)

    def check_target(self, target: ModelConfig) -> None:
        if target.hidden_size != self.hidden_size or target.vocab_size != self.vocab_size:
            raise ValueError(f"drafter expects hidden {self.hidden_size} / vocab {self.vocab_size}, "
                             f"the target has {target.hidden_size} / {target.vocab_size}")  # fmt: skip
        if max(self.target_layer_ids) >= target.num_hidden_layers:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} exceed the target's "
                             f"{target.num_hidden_layers} layers")  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DSparkConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown DSparkConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**d)


@dataclass
class Draft:
    """One block per request. probs_BNV is the distribution token k was drawn from (None when
    every request is greedy: the verifier then compares argmaxes only)."""

    tokens_BN: torch.Tensor  # int64
    probs_BNV: torch.Tensor | None  # fp32
    confidence_BN: torch.Tensor  # fp32, c_k in (0, 1)

    @property
    def survival_BN(self) -> torch.Tensor:
        return self.confidence_BN.cumprod(dim=-1)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention keys are [context ; block] (no causal mask)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        D, H, G, C = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, C
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(D, H * C, bias=False)
        self.k_proj = nn.Linear(D, G * C, bias=False)
        self.v_proj = nn.Linear(D, G * C, bias=False)
        self.o_proj = nn.Linear(H * C, D, bias=False)
        self.q_norm = RMSNorm(C, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(C, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, D, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """K and V of (already normed) vectors x [..., D] -> [..., 2, G, C] (K normed and rotated)."""
        G, C = self.num_kv_heads, self.head_dim
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (G, C))), cos, sin)
        v = self.v_proj(x).unflatten(-1, (G, C))
        return torch.stack([k, v], dim=-3)

    def forward(
        self,
        x_BMD: torch.Tensor,
        cos_BMR: torch.Tensor,
        sin_BMR: torch.Tensor,
        ctx_kv_BS2GC: torch.Tensor,
        allowed_BMK: torch.Tensor,
    ) -> torch.Tensor:
        H, C = self.num_heads, self.head_dim
        h_BMD = self.input_layernorm(x_BMD)
        q_BMHC = apply_rope(self.q_norm(self.q_proj(h_BMD).unflatten(-1, (H, C))), cos_BMR, sin_BMR)
        kv_BK2GC = torch.cat([ctx_kv_BS2GC, self.kv(h_BMD, cos_BMR, sin_BMR)], dim=1)  # K = S + M keys
        out_BHMC = F.scaled_dot_product_attention(
            q_BMHC.transpose(1, 2),
            kv_BK2GC[:, :, 0].transpose(1, 2),
            kv_BK2GC[:, :, 1].transpose(1, 2),
            attn_mask=allowed_BMK[:, None],
            enable_gqa=True,
        )
        x_BMD = x_BMD + self.o_proj(out_BHMC.transpose(1, 2).flatten(2))
        h_BMD = self.post_attention_layernorm(x_BMD)
        return x_BMD + self.down_proj(F.silu(self.gate_proj(h_BMD)) * self.up_proj(h_BMD))


class Drafter(nn.Module):
    """DSpark drafter; call `bind(target)` before use (shares its embedding and lm_head)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        D, R = config.hidden_size, config.markov_rank
        self.fc = nn.Linear(len(config.target_layer_ids) * D, D, bias=False)
        self.context_norm = RMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(D))
        self.markov_in = nn.Embedding(config.vocab_size, R)  # W1
        self.markov_out = nn.Linear(R, config.vocab_size, bias=False)  # W2
        self.confidence = nn.Linear(D + R, 1)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # not submodules: not saved

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> Drafter:
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.zero_()
        self.markov_out.weight.zero_()  # the Markov bias starts at 0: U_k alone at first
        self.mask_embedding.copy_(torch.randn(self.mask_embedding.shape, generator=gen) * std)
        return self

    def bind(self, target: nn.Module) -> Drafter:
        """Share `target`'s embedding and lm_head (frozen: the drafter never trains them)."""
        self.config.check_target(target.config)
        self._shared = (target.model.embed_tokens, target.lm_head)
        return self

    @property
    def embed_tokens(self) -> nn.Embedding:
        if self._shared is None:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target) first")
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        if self._shared is None:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target) first")
        return self._shared[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ------------------------------------------------------------------ context
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta)

    def context_kv(self, target_hidden_TX: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Per-layer context K/V of tokens from their captured target states [..., L*D] ->
        [..., num_layers, 2, G, C] (what the drafter cache stores per token)."""
        c = self.context_norm(self.fc(target_hidden_TX.to(self.dtype)))
        cos, sin = self._rope(positions_T)
        return torch.stack([layer.kv(c, cos, sin) for layer in self.layers], dim=-4)

    # ------------------------------------------------------------------ block pass
    def block_hidden(
        self,
        first_ids_BA: torch.Tensor,
        first_pos_BA: torch.Tensor,
        ctx_kv_BSL2GC: torch.Tensor,
        ctx_allowed_BAS: torch.Tensor,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, A, N, D] of A blocks per row: block a is anchor
        first_ids[b, a] at first_pos[b, a] then N - 1 mask vectors; it sees the context tokens
        allowed for it and the whole of its own block (never the other blocks)."""
        B, A = first_ids_BA.shape
        N = self.config.block_size
        dev = first_ids_BA.device
        anchor_BAD = self.embed_tokens(first_ids_BA).to(self.dtype)
        mask_BAND = self.mask_embedding.to(self.dtype).expand(B, A, N - 1, -1)
        x_BMD = torch.cat([anchor_BAD[:, :, None], mask_BAND], dim=2).flatten(1, 2)  # M = A * N
        pos_BM = (first_pos_BA[:, :, None] + torch.arange(N, device=dev)).flatten(1)
        cos, sin = self._rope(pos_BM)
        block_of_M = torch.arange(A, device=dev).repeat_interleave(N)
        same_block_MM = block_of_M[:, None] == block_of_M[None, :]
        ctx_BMS = ctx_allowed_BAS.repeat_interleave(N, dim=1)
        allowed_BMK = torch.cat([ctx_BMS, same_block_MM.expand(B, -1, -1)], dim=-1)
        for i, layer in enumerate(self.layers):
            x_BMD = layer(x_BMD, cos, sin, ctx_kv_BSL2GC[:, :, i], allowed_BMK)
        return self.norm(x_BMD).unflatten(1, (A, N))

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    def markov_logits(
        self, base_logits: torch.Tensor, prev_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(U + W2(W1[prev]) in fp32, W1[prev]) for any leading shape."""
        e = self.markov_in(prev_ids)
        return base_logits + self.markov_out(e).float(), e

    def confidence_logit(self, h: torch.Tensor, markov_emb: torch.Tensor) -> torch.Tensor:
        return self.confidence(torch.cat([h.to(self.dtype), markov_emb], dim=-1))[..., 0].float()

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def draft(
        self,
        anchor_ids_B: torch.Tensor,
        anchor_pos_B: torch.Tensor,
        ctx_kv_BSL2GC: torch.Tensor,
        ctx_valid_BS: torch.Tensor,
        temperature_B: torch.Tensor,
        rngs: list[sampler.CounterRNG | None],
    ) -> Draft:
        """Draft N tokens per request: argmax for greedy rows (temperature 0), else a sample from
        softmax(logits / T) with the row's rng, left to right through the Markov head."""
        h_BND = self.block_hidden(
            anchor_ids_B[:, None], anchor_pos_B[:, None], ctx_kv_BSL2GC, ctx_valid_BS[:, None]
        )
        h_BND = h_BND[:, 0]
        U_BNV = self.base_logits(h_BND)
        N, V = U_BNV.shape[1:]
        is_sampling = any(g is not None for g in rngs)
        prev_B = anchor_ids_B
        tokens, probs, conf = [], [], []
        for k in range(N):
            logits_BV, e_BR = self.markov_logits(U_BNV[:, k], prev_B)
            scaled_BV = sampler.temperature_scaled(logits_BV, temperature_B)
            q_BV = torch.softmax(scaled_BV, dim=-1)
            noise_BV = sampler.exponential_noise(rngs, V, q_BV.device) if is_sampling else None
            prev_B = (q_BV / noise_BV).argmax(-1) if is_sampling else scaled_BV.argmax(-1)
            prev_B = torch.where(temperature_B > 0, prev_B, scaled_BV.argmax(-1))
            tokens.append(prev_B)
            probs.append(q_BV)
            conf.append(torch.sigmoid(self.confidence_logit(h_BND[:, k], e_BR)))
        return Draft(
            torch.stack(tokens, 1), torch.stack(probs, 1) if is_sampling else None, torch.stack(conf, 1)
        )


# ---------------------------------------------------------------------- save / load
def dspark_dir(path: str | Path) -> Path:
    """The drafter folder of a checkpoint directory (or the folder itself if it is one)."""
    path = Path(path)
    return path if (path / CONFIG_FILE).exists() and path.name == DSPARK_DIR else path / DSPARK_DIR


def save_drafter(drafter: Drafter, ckpt_dir: str | Path) -> Path:
    """Write `ckpt_dir/dspark/{config.json, model.safetensors}` atomically (staging + rename)."""
    out = Path(ckpt_dir) / DSPARK_DIR
    staging = out.with_name(out.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(staging / WEIGHTS_FILE))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)
    return out


def load_drafter(
    ckpt_dir: str | Path, target: nn.Module | None = None, device: str | torch.device = "cpu"
) -> Drafter:
    """Read a drafter written by `save_drafter` (strict: every tensor, exact shapes); bind it to
    `target` when given, and move it to `device` in its configured dtype."""
    d = dspark_dir(ckpt_dir)
    if not (d / CONFIG_FILE).exists() or not (d / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"no DSpark drafter at {d}: expected {CONFIG_FILE} and {WEIGHTS_FILE} "
                                f"(train one with `python -m rollout.dspark.train`)")  # fmt: skip
    cfg = DSparkConfig.from_dict(json.loads((d / CONFIG_FILE).read_text()))
    drafter = Drafter(cfg)
    drafter.load_state_dict(load_file(str(d / WEIGHTS_FILE)), strict=True)
    drafter = drafter.to(device=device, dtype=_TORCH_DTYPE[cfg.dtype]).eval()
    drafter.requires_grad_(False)
    return drafter.bind(target) if target is not None else drafter
