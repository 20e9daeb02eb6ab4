"""How many drafted tokens to verify per request: fixed length or confidence-scheduled.

What: `SpecConfig` (mode, tokens verified at most); `StepCost` (a pass's time as base_s +
per_token_s * T for the target, plus the drafter pass, profiled once by the proposer);
`choose_num_verify`, which picks per request a prefix length maximising expected tokens per expected
time from the drafter's survival S_bk = prod_{i<=k} c_bi. Why: on a memory-bound GPU a verify pass
costs about the same for 1 or 8 extra tokens (verify everything); on a CPU or at high concurrency
every verified token costs, and unlikely ones are not worth their time.

Invariants: each request's choice is a prefix of its block; one host sync, for the chosen lengths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# Legend: B requests speculating this step, N block size.
#
# The objective: (sum_b (1 + sum_{k<=k_b} S_bk) + extra) / (t_draft(B) + t(T0 + sum_b k_b)). Because
# S_bk does not increase with k, the best choice takes the globally largest S values first: sort them
# (ties keep k order, so each choice stays a prefix), evaluate the ratio for every count, keep the best.

SpecMode = Literal["fixed", "scheduled"]


@dataclass(frozen=True)
class SpecConfig:
    """mode "fixed" verifies min(num_verify, block) drafts for every request; "scheduled" chooses
    up to num_verify per request from the drafter's confidences (notes at the top of the module). num_verify
    None = the drafter's block size."""

    mode: SpecMode = "fixed"
    num_verify: int | None = None
    profile_repeats: int = 3  # timed repeats per profiled size (median)

    def __post_init__(self):
        if self.mode not in ("fixed", "scheduled"):
            raise ValueError(f"SpecConfig.mode must be 'fixed' or 'scheduled', got {self.mode!r}")
        if self.num_verify is not None and not (isinstance(self.num_verify, int) and self.num_verify >= 1):
            raise ValueError(f"SpecConfig.num_verify must be None or an int >= 1, got {self.num_verify!r}")
        if not (isinstance(self.profile_repeats, int) and self.profile_repeats >= 1):
            raise ValueError(f"SpecConfig.profile_repeats must be an int >= 1, got {self.profile_repeats!r}")


@dataclass(frozen=True)
class StepCost:
    base_s: float  # fixed cost of a pass (launches, weight reads)
    per_token_s: float  # extra cost of each token (target) or sequence (drafter) in it

    def __call__(self, num_tokens: float) -> float:
        return self.base_s + self.per_token_s * num_tokens


def fit_step_cost(tokens: list[int], seconds: list[float]) -> StepCost:
    """Least-squares line through (tokens, seconds); the slope is clamped at >= 0."""
    t = torch.tensor(tokens, dtype=torch.float64)
    s = torch.tensor(seconds, dtype=torch.float64)
    if len(tokens) < 2 or float(t.var()) == 0:
        return StepCost(float(s.mean()), 0.0)
    slope = float(((t - t.mean()) * (s - s.mean())).sum() / ((t - t.mean()) ** 2).sum())
    slope = max(slope, 0.0)
    base = max(float(s.mean()) - slope * float(t.mean()), 0.0)
    return StepCost(base, slope)


def time_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() after one warm-up (synchronised on CUDA: a one-off profile)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # SYNC: profiling only, once per engine

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def choose_num_verify(
    survival_BN: torch.Tensor,
    max_verify_B: torch.Tensor,
    fixed_s: float,
    per_token_s: float,
    extra_value: float,
) -> list[int]:
    """Per request the number of drafts to verify (notes at the top of the module). fixed_s: the step's time
    without any verified draft (drafter pass, target pass over anchors and prefill chunks);
    per_token_s: each verified draft's extra time; extra_value: tokens produced anyway (one per
    speculating request and per other sampled row)."""
    B, N = survival_BN.shape
    if B == 0:
        return []
    dev = survival_BN.device
    k_N = torch.arange(N, device=dev)
    gain_BN = torch.where(k_N[None, :] < max_verify_B[:, None], survival_BN.float(), 0.0)
    order = gain_BN.flatten().sort(descending=True, stable=True).indices
    gains = gain_BN.flatten()[order]
    counts = torch.arange(B * N + 1, device=dev, dtype=torch.float64)
    value = extra_value + torch.cat([gains.new_zeros(1), gains.cumsum(0)]).double()
    rate = value / (fixed_s + per_token_s * counts)
    # Never verify a draft that cannot be accepted (gain 0: past the cap or zero confidence).
    rate = torch.where(torch.cat([counts.new_ones(1, dtype=torch.bool), gains > 0]), rate, -1.0)
    best = rate.argmax()
    chosen_BN = torch.zeros(B * N, dtype=torch.long, device=dev)
    chosen_BN[order[:best]] = 1  # best = number of (request, position) pairs taken
    return chosen_BN.view(B, N).sum(-1).tolist()  # SYNC: the scheduler needs the lengths
