"""The rollout engine protocol and the typed records that cross it (docs/ARCHITECTURE.md, engine protocol).

What: `Engine` (generate / set_adapter / stats), `SamplingParams`, `Request`, `Completion`,
`EngineStats`: every backend (rollout/native, the vLLM wrapper) speaks these types and the trainer
sees only them. Conventions the trainer relies on (reasons in the comment below the imports):
- `Completion.logprobs[i]` = log_softmax(logits / T)[token_i] in fp32, before top-k / top-p / min-p
  truncation (greedy reports T = 1);
- sample i of a request with seed s draws from seed s + i; unseeded requests get seeds from the
  engine's own seeded generator;
- stop tokens, and the token completing a stop string, are kept in `token_ids`;
- `adapter_versions[i]` sampled token i; `adapter_version` is the first (the oldest policy used);
- `Request.images` come in placeholder order; image ids are never sampled.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from model.vision.preprocess import ProcessedImage

# Why these conventions:
# - Log-probs before truncation are what a GRPO trainer recomputes (`token_logprobs(logits / T)`); at
#   T = 1 without truncation they equal vLLM's "raw_logprobs" ("processed_logprobs" renormalises over
#   the truncated support, which the trainer cannot reproduce).
# - Seeds s + i is vLLM's rule for n > 1: `Request(seed=s, n=4)` yields the same samples as the four
#   requests `Request(seed=s + i, n=1)`; give GRPO groups seeds at least n apart.
# - Stop tokens are kept because the trainer must score the EOS it sampled.
# - Images: model.vision.chat_to_ids_and_images builds ids and images together, and the engine checks
#   that the placeholder count equals their token count. Banning image ids is a truncation like
#   top-k, so `logprobs` stay over the full vocabulary.

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. top_k = 0 and top_p = 1 and min_p = 0 disable truncation.

    Truncation order: temperature, then top-k, then top-p over the top-k renormalised
    distribution, then min-p (tokens below min_p * max prob dropped). Each keeps a prefix of
    the tokens sorted by probability, so the kept set is the shortest of the three prefixes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # False: the model's eos_token_id also stops

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty str, got {self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One prompt to sample `n` times. Vocabulary and length checks happen in the engine, which
    knows the model; here only what needs no model."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    seed: int | None = None
    request_id: str | None = None
    images: tuple[ProcessedImage, ...] = ()

    def __post_init__(self):
        ids = self.prompt_token_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = tuple(ids)
        if not ids:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be ints")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in ids))
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        object.__setattr__(self, "images", tuple(self.images))
        if not all(isinstance(im, ProcessedImage) for im in self.images):
            raise ValueError(
                "images must be model.vision.ProcessedImage objects (preprocess_image / "
                "chat_to_ids_and_images make them)"
            )


@dataclass(eq=False)  # holds a tensor: compare fields explicitly
class Completion:
    """One sample of one request. `logprobs` is fp32 [len(token_ids)] (convention above)."""

    request_id: str
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    stop_reason: int | str | None  # the stop token id or stop string that ended it, if any
    adapter_versions: list[int]
    seed: int
    num_preemptions: int = 0
    queue_s: float = 0.0  # request added -> first scheduled
    ttft_s: float = 0.0  # request added -> first token sampled
    e2e_s: float = 0.0  # request added -> finished
    spec_drafted: int = 0  # speculative decoding: draft tokens verified / accepted (0 without)
    spec_accepted: int = 0
    spec_steps: int = 0  # verification passes of this sample (each emits accepted + 1 tokens)

    @property
    def adapter_version(self) -> int:
        return self.adapter_versions[0]


@dataclass
class EngineStats:
    """Cumulative counters since the engine was built (rates over time spent in steps)."""

    steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0  # tokens run in prefill chunks (all but one-token decode steps)
    preemptions: int = 0
    shared_prefix_pages: int = 0  # pages reused by group samples instead of recomputed
    pages_in_use: int = 0
    pages_total: int = 0
    step_time_s: float = 0.0
    adapter_version: int = 0
    # Speculative decoding (0 without): verification passes (one per sequence per step), draft
    # tokens verified / accepted in them, and the time spent in the drafter.
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    draft_time_s: float = 0.0
    # Images: encoded by the vision tower vs served from the engine's feature cache.
    images_encoded: int = 0
    image_cache_hits: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def spec_accept_len(self) -> float:
        """Mean tokens emitted per verification pass (accepted drafts + the resampled/bonus one)."""
        return (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0


class Engine(Protocol):
    def generate(self, requests: list[Request]) -> list[Completion]:
        """All samples of all requests, ordered by request then sample index."""
        ...

    def set_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def stats(self) -> EngineStats: ...
