"""The MiniMax-M3 causal LM (M3, M3.1-Flash and their small twins), read bottom-up.

What: `DecoderLayer` (norm -> attention -> residual -> norm -> dense MLP or MoE -> residual) and
`MiniMaxM3ForCausalLM` with two entry points: `forward` / `token_logprobs` (full sequences for
training, packing through `seq_ids_BS`, log-probs without all [B, S, V] logits at once) and
`forward_cached` (one engine step of T flattened tokens over the paged KV cache). Why one file: the
network fits on a few screens; numerics live in model/layers and model/kernels. Names copy the
checkpoint (`model.layers.{i}.self_attn.q_proj`, ...), so loading is a straight copy.

Invariants: routed experts are frozen and never upcast as a whole; `forward_cached` token by token
reproduces `forward` (1e-5 in fp32), and with an NVFP4 cache `forward(kv_sim=True)`; image features
overwrite the placeholder embeddings right after `embed_tokens` (the frozen tower in `self.vision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers.attention import Attention
from model.layers.moe import DenseMLP, MoE
from model.layers.norm import RMSNorm
from model.vision.tower import VisionModel, merge_image_features

# Legend: B batch, S sequence, T flattened tokens, D hidden, V vocab, P pages per sequence.
#
# Images (`config.vision`): the tower + projector (model/vision/tower.py) is never quantized and never
# adapted by the text LoRA. `forward` takes `images` (`ProcessedImage`s in prompt order, rows
# concatenated over the batch in reading order) or precomputed `image_features_NE`; `forward_cached`
# takes the feature rows of exactly the placeholder tokens among its T new tokens (the engine slices
# them per prefill chunk), so a chunk boundary may fall inside an image's span.

if TYPE_CHECKING:
    from model.vision.preprocess import ProcessedImage


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Checkpoint names differ by layer kind: dense prefix layers own `mlp`, MoE layers own
        # `block_sparse_moe` (router + experts + shared expert).
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.dense_intermediate_size, config)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        out = self.ffn(self.post_attention_layernorm(h).reshape(-1, shape[-1]))
        return out.reshape(shape)

    def forward(
        self,
        x_BSD: torch.Tensor,
        positions_BS: torch.Tensor,
        seq_ids_BS: torch.Tensor | None,
        kv_sim: bool,
    ) -> torch.Tensor:
        h_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), positions_BS, seq_ids_BS, kv_sim=kv_sim)
        return h_BSD + self._ffn(h_BSD)

    def forward_cached(
        self,
        x_TD: torch.Tensor,
        positions_T: torch.Tensor,
        seq_idx_T: torch.Tensor,
        cache: KVCache,
        block_tables_BP: torch.Tensor,
        seq_lens_B: torch.Tensor,
        shared: dict | None = None,
    ) -> torch.Tensor:
        h_TD, out_TD = self.forward_cached_split(
            x_TD, None, positions_T, seq_idx_T, cache, block_tables_BP, seq_lens_B, shared
        )
        return h_TD + out_TD

    def forward_cached_split(
        self,
        x_TD: torch.Tensor,
        pending_TD: torch.Tensor | None,
        positions_T: torch.Tensor,
        seq_idx_T: torch.Tensor,
        cache: KVCache,
        block_tables_BP: torch.Tensor,
        seq_lens_B: torch.Tensor,
        shared: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_cached` of x_TD + pending_TD (the previous layer's FFN output not yet added; None:
        x_TD alone) as (h_TD, ffn_out_TD), the last residual add left to the caller: every residual
        add then runs with the norm after it (`RMSNorm.add_forward`, one launch on the engine path)."""
        if pending_TD is None:
            normed_TD = self.input_layernorm(x_TD)
        else:
            x_TD, normed_TD = self.input_layernorm.add_forward(x_TD, pending_TD)
        attn_TD = self.self_attn.forward_cached(
            normed_TD, positions_T, seq_idx_T, cache, block_tables_BP, seq_lens_B, shared
        )
        h_TD, normed_TD = self.post_attention_layernorm.add_forward(x_TD, attn_TD)
        return h_TD, self.ffn(normed_TD)


class MiniMaxM3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiniMaxM3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = MiniMaxM3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        vcfg = config.vision
        if vcfg is not None:
            bad = [i for i in _vision_ids(vcfg) if i >= config.vocab_size]
            if bad:
                raise ValueError(
                    f"vision token ids {bad} are outside the vocabulary (vocab_size={config.vocab_size}); "
                    "the vision part of the config belongs to another text model"
                )
        # Registered after lm_head: the text parameters keep their order (and init_weights draws).
        self.vision = VisionModel(vcfg).requires_grad_(False) if vcfg is not None else None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> MiniMaxM3ForCausalLM:
        """Fresh random weights (tiny models, tests): N(0, std^2) linears, embeddings and experts;
        norms at 0 (Gemma norms scale by 1 + w); router bias 0. Deterministic given `seed`."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue  # its own init below (LayerNorms at 1, biases random)
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.zero_()
        for layer in self.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.experts.init_normal_(std, generator=gen)
                layer.block_sparse_moe.e_score_correction_bias.zero_()
        if self.vision is not None:
            self.vision.init_weights(std, seed)
        return self

    def new_kv_cache(self, num_pages: int, device: torch.device | str | None = None, **kwargs) -> KVCache:
        """A paged cache laid out for this model (per-layer dtypes from the config unless `dtype`
        overrides) with each layer's K/V/index scales installed, as `forward(kv_sim=True)` uses them."""
        device = device if device is not None else self.lm_head.weight.device
        return self.install_kv_scales(KVCache(self.config, num_pages, device=device, **kwargs))

    def install_kv_scales(self, cache: KVCache) -> KVCache:
        """Give `cache` (any KVCache, e.g. a DCP shard) each layer's K/V/index scales; returns it."""
        for i, layer in enumerate(self.model.layers):
            cache.set_scales(i, *layer.self_attn.kv_scales())
        return cache

    # ------------------------------------------------------------------ images
    @property
    def vision_token_ids(self) -> tuple[int, ...]:
        """Ids that stand for image content (placeholders and brackets): never sampled, never targets."""
        return () if self.vision is None else _vision_ids(self.vision.config)

    def image_features(self, images: Sequence[ProcessedImage]) -> torch.Tensor:
        """Text-width features [N, D] of `images`, concatenated in order (model/vision/tower.py)."""
        if self.vision is None:
            raise ValueError(
                "this model has no vision tower (its config has no vision_config): image inputs need a "
                "minimax_m3_vl checkpoint or the tiny-vl preset"
            )
        return torch.cat(self.vision.encode_images(images))

    def embed(
        self,
        input_ids: torch.Tensor,
        images: Sequence[ProcessedImage] | None = None,
        image_features_NE: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the image placeholder rows replaced by image features (reading
        order over the whole batch; their number must equal the placeholder count)."""
        x = self.model.embed_tokens(input_ids)
        if images:
            if image_features_NE is not None:
                raise ValueError("give images or image_features_NE, not both")
            image_features_NE = self.image_features(images)
        if image_features_NE is None:
            return x
        if self.vision is None:
            raise ValueError("image_features_NE given to a model without a vision tower")
        return merge_image_features(x, input_ids, image_features_NE, self.vision.config.image_token_id)

    # ------------------------------------------------------------------ training forward
    def hidden_states(
        self,
        input_ids_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        seq_ids_BS: torch.Tensor | None = None,
        kv_sim: bool = False,
        images: Sequence[ProcessedImage] | None = None,
        image_features_NE: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, S, D]. `seq_ids_BS` marks packed sequences (equal ids attend
        to each other; -1 = padding); `positions_BS` then restart at 0 per packed sequence.
        `images` / `image_features_NE`: see the notes at the top of the module."""
        if positions_BS is None:
            positions_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(
                input_ids_BS
            )
        x_BSD = self.embed(input_ids_BS, images, image_features_NE)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x_BSD = checkpoint(layer, x_BSD, positions_BS, seq_ids_BS, kv_sim, use_reentrant=False)
            else:
                x_BSD = layer(x_BSD, positions_BS, seq_ids_BS, kv_sim)
        return self.model.norm(x_BSD)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        seq_ids_BS: torch.Tensor | None = None,
        kv_sim: bool = False,
        images: Sequence[ProcessedImage] | None = None,
        image_features_NE: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] in fp32."""
        h_BSD = self.hidden_states(input_ids_BS, positions_BS, seq_ids_BS, kv_sim, images, image_features_NE)
        return self.lm_head(h_BSD).float()

    def token_logprobs(
        self,
        input_ids_BS: torch.Tensor,
        targets_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        seq_ids_BS: torch.Tensor | None = None,
        kv_sim: bool = False,
        chunk_tokens: int = 1024,
        with_entropy: bool = False,
        temperature: float = 1.0,
        images: Sequence[ProcessedImage] | None = None,
        image_features_NE: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(targets[b, s] | input[b, :s+1]) as fp32 [B, S], and the entropy of each position's
        distribution when asked. Logits are formed `chunk_tokens` rows at a time so a 200K vocab
        never needs [B, S, V] in memory (each chunk is recomputed in backward by checkpointing).
        `temperature` divides the logits first: the distribution the engine sampled from."""
        h_TD = self.hidden_states(
            input_ids_BS, positions_BS, seq_ids_BS, kv_sim, images, image_features_NE
        ).flatten(0, 1)
        targets_T = targets_BS.flatten()
        logp_parts, ent_parts = [], []
        for start in range(0, h_TD.shape[0], chunk_tokens):
            h = h_TD[start : start + chunk_tokens]
            t = targets_T[start : start + chunk_tokens]
            if torch.is_grad_enabled() and h.requires_grad:
                lp, ent = checkpoint(
                    _chunk_logprobs, h, self.lm_head.weight, t, with_entropy, temperature, use_reentrant=False
                )
            else:
                lp, ent = _chunk_logprobs(h, self.lm_head.weight, t, with_entropy, temperature)
            logp_parts.append(lp)
            ent_parts.append(ent)
        logp_BS = torch.cat(logp_parts).view_as(targets_BS)
        ent_BS = torch.cat(ent_parts).view_as(targets_BS) if with_entropy else None
        return logp_BS, ent_BS

    # ------------------------------------------------------------------ engine step
    def forward_cached(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        seq_idx_T: torch.Tensor,
        cache: KVCache,
        block_tables_BP: torch.Tensor,
        seq_lens_B: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        image_features_NE: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append T new tokens to the paged cache and return fp32 logits for `logits_indices`
        (default: every token). `seq_lens_B` counts each sequence's tokens *including* the new
        ones; the caller's page tables must already cover them. `image_features_NE` holds one row
        per image placeholder among the T tokens, in order (the caller counted them on the host:
        no device sync here)."""
        x_TD = self.model.embed_tokens(input_ids_T)
        if image_features_NE is not None:
            if self.vision is None:
                raise ValueError("image_features_NE given to a model without a vision tower")
            is_image_T1 = (input_ids_T == self.vision.config.image_token_id).unsqueeze(-1)
            x_TD = x_TD.masked_scatter(is_image_T1, image_features_NE.to(x_TD.dtype))
        shared: dict = {}  # per-step tables the layers compute once (RoPE cos / sin, slot mapping)
        pending_TD = None  # the last layer's FFN output, added to the stream by the next norm's launch
        for layer in self.model.layers:
            x_TD, pending_TD = layer.forward_cached_split(
                x_TD, pending_TD, positions_T, seq_idx_T, cache, block_tables_BP, seq_lens_B, shared
            )
        return self.cached_logits(x_TD, pending_TD, logits_indices)

    def cached_logits(
        self, x_TD: torch.Tensor, pending_TD: torch.Tensor | None, logits_indices: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 logits of rows `logits_indices` (None: all) of the stream x_TD + pending_TD (the last
        layer's `forward_cached_split` output; the add runs inside the final norm's launch)."""
        if logits_indices is not None:
            x_TD = x_TD[logits_indices]
            pending_TD = None if pending_TD is None else pending_TD[logits_indices]
        if pending_TD is None:
            return self.lm_head(self.model.norm(x_TD)).float()
        return self.lm_head(self.model.norm.add_forward(x_TD, pending_TD)[1]).float()

    # ------------------------------------------------------------------ bookkeeping
    def num_parameters(self) -> int:
        """Logical parameter count: float parameters plus quantized expert weights counted per value."""
        n = sum(p.numel() for p in self.parameters())
        for layer in self.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                n += layer.block_sparse_moe.experts.num_quantized_values()
        return n


def _vision_ids(vcfg) -> tuple[int, ...]:
    ids = (vcfg.image_token_id, vcfg.video_token_id, vcfg.vision_start_token_id, vcfg.vision_end_token_id)
    return tuple(i for i in ids if i is not None)


def _chunk_logprobs(
    h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, with_entropy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_TV = F.linear(h_TD, w_VD).float()
    if temperature != 1.0:
        logits_TV = logits_TV / temperature
    logz_T = torch.logsumexp(logits_TV, dim=-1)
    logp_T = logits_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1) - logz_T
    if with_entropy:
        p_TV = torch.softmax(logits_TV, dim=-1)
        ent_T = logz_T - (p_TV * logits_TV).sum(-1)
    else:
        ent_T = logp_T.new_zeros(0)
    return logp_T, ent_T
