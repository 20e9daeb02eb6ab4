"""LoRA adapters on the frozen (NVFP4 or float) MiniMax-M3 base.

What: `LoRALinear` (shares the wrapped layer's weight, adds B(A(x)) * alpha / r), `ExpertLoRA`
(per-expert A/B stacked [E, r, in] / [E, out, r] on the `ExpertBank.lora` hook), and `apply_lora`,
`lora_state_dict`, `load_lora_state_dict`, `lora_num_parameters`, `lora_num_bytes`, `merge_lora`;
the config is model/layers/lora_config.py's `LoRAConfig`. Why: only adapters train and move.
Invariants: the base is never copied and is frozen (names and `base_fingerprint` unchanged); PEFT's
init (A Kaiming-uniform, B zeros) makes a fresh adapter bit-identical to the base; adapter names end
in `lora_A.weight` / `lora_B.weight`. Legend: M tokens, I / O features, R rank, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels.inference_path import triton_inference_path
from model.kernels.moe import Proj
from model.layers.lora_config import (  # noqa: F401  (the names adapter code imports from here)
    DEFAULT_TARGETS,
    PROJECTOR_TARGETS,
    TARGET_MODULES,
    AdapterDtype,
    LoRAConfig,
    ProjectorTarget,
    TargetModule,
)
from model.layers.moe import PROJS, ExpertBank


def _init_lora_A_(w_RI: torch.Tensor, generator: torch.Generator | None) -> None:
    """PEFT's default A init: nn.Linear's Kaiming-uniform rule, bound = 1 / sqrt(fan_in)."""
    if w_RI.is_meta:  # parameter accounting on the meta device: nothing to fill
        return
    # Drawn on the CPU so a seeded adapter is the same tensor whatever device the base lives on.
    w_cpu = torch.empty(w_RI.shape, dtype=w_RI.dtype)
    nn.init.kaiming_uniform_(w_cpu, a=math.sqrt(5), generator=generator)
    w_RI.copy_(w_cpu)


class LoRALinear(nn.Linear):
    """y = x W^T (+ b) + dropout(x) A^T B^T * scaling, W / b the wrapped layer's own Parameters.

    Subclasses nn.Linear so code that inspects linears (quantization, counting) still sees one, but
    never allocates a weight of its own.
    """

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ):
        nn.Module.__init__(self)  # skip nn.Linear.__init__: it would allocate a second weight
        if isinstance(base, LoRALinear):
            raise ValueError("LoRALinear: the layer already has an adapter")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: frozen base, same name, no copy
        self.bias = base.bias
        self.r, self.alpha, self.scaling = r, float(alpha), alpha / r
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, dtype=dtype, device=device)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, dtype=dtype, device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        with torch.no_grad():
            _init_lora_A_(self.lora_A.weight, generator)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and isinstance(self.lora_dropout, nn.Identity) and triton_inference_path(x):
            from model.kernels.triton_lora import add_lora_delta_, lora_delta_supported

            a, b = self.lora_A.weight, self.lora_B.weight
            if lora_delta_supported(x, y, a, b):  # fp32 adapters: the delta in two launches, in place
                return add_lora_delta_(y, x, a, b, self.scaling)
        x_lora = self.lora_dropout(x).to(self.lora_A.weight.dtype)
        delta = self.lora_B(self.lora_A(x_lora)) * self.scaling
        return y + delta.to(y.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling as fp32 [O, I]: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear around the same (shared) weight and bias, adapter dropped."""
        lin = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha:g}"


class _ProjLoRA(nn.Module):
    """One projection's per-expert factors: lora_A [E, R, I], lora_B [E, O, R]."""

    def __init__(self, e: int, n_out: int, n_in: int, r: int, dtype: torch.dtype, device, generator):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(e, r, n_in, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(e, n_out, r, dtype=dtype, device=device))
        with torch.no_grad():
            for i in range(e):  # each expert's A initialised as its own nn.Linear would be
                _init_lora_A_(self.lora_A[i], generator)


class ExpertLoRA(nn.Module):
    """Per-expert LoRA for a routed `ExpertBank`, called by the bank as its `lora` hook
    (`model.kernels.moe.ExpertDelta`): (e, proj, x_MI) -> x A_e^T B_e^T * scaling, [M, O]."""

    def __init__(
        self,
        bank: ExpertBank,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
        num_experts: int | None = None,
    ):
        """`num_experts` (default: the bank's) sizes the factors; `apply_lora` passes a partial bank's
        total_experts so the adapter covers (and draws exactly as) the whole layer."""
        super().__init__()
        n = bank.num_experts if num_experts is None else num_experts
        self.num_experts, self.r, self.alpha, self.scaling = n, r, float(alpha), alpha / r
        device = bank.w1_weight.device
        for proj, (n_out, n_in) in bank.proj_shapes().items():
            self.add_module(proj, _ProjLoRA(n, n_out, n_in, r, dtype, device, generator))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, e: int, proj: Proj, x_MI: torch.Tensor) -> torch.Tensor:
        p: _ProjLoRA = getattr(self, proj)
        x = self.lora_dropout(x_MI).to(p.lora_A.dtype)
        return ((x @ p.lora_A[e].T) @ p.lora_B[e].T * self.scaling).to(x_MI.dtype)

    @torch.no_grad()
    def delta_weight(self, e: int, proj: Proj) -> torch.Tensor:
        p: _ProjLoRA = getattr(self, proj)
        return (p.lora_B[e].float() @ p.lora_A[e].float()) * self.scaling


class OffsetExpertLoRA(nn.Module):
    """A whole-layer per-expert adapter seen from a partial bank: local expert e -> global e + offset.

    It registers the wrapped adapter's children and parameters under their own names, so the
    adapter's state-dict names (`experts.lora.w1.lora_A`, ...) and tensors are the whole layer's
    (adapter sync and export are unchanged); only the expert index is shifted."""

    def __init__(self, inner: nn.Module, offset: int):
        super().__init__()
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner.named_parameters(recurse=False):
            self.register_parameter(name, p)
        object.__setattr__(self, "inner", inner)  # not a submodule: its tensors are registered above
        self.offset = offset

    def forward(self, e: int, proj, x_MI: torch.Tensor) -> torch.Tensor:
        return self.inner(e + self.offset, proj, x_MI)


# ------------------------------------------------------------------------------ model level
def _is_target(name: str, targets: set[str]) -> bool:
    leaf = name.rpartition(".")[2]
    if leaf not in targets:
        return False
    # The vision tower's attention is also `self_attn.q_proj`...: text targets never reach it (the
    # projector has its own entry point, model/vision/lora.py). Its linears are also VisionLinear.
    if name.startswith("vision.") or ".vision." in name:
        return False
    # MLP names only under the dense `mlp` or the MoE `shared_experts` (not e.g. a drafter's layers).
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        return ".mlp." in name or ".shared_experts." in name
    return ".self_attn." in name


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> nn.Module:
    """Add adapters in place to every targeted linear (and routed-expert bank if asked), freeze the
    rest, return the model. A-factors are drawn on the CPU from a generator seeded with `seed`, in
    module order, so two processes building the same adapter get the same tensors on any device."""
    if any(isinstance(m, LoRALinear | ExpertLoRA) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    model.requires_grad_(False)
    targets = set(cfg.target_modules)
    hits = [
        (name, m) for name, m in model.named_modules() if type(m) is nn.Linear and _is_target(name, targets)
    ]
    banks = [m for m in model.modules() if isinstance(m, ExpertBank)] if cfg.routed_experts else []
    if not hits and not banks and not cfg.projector_modules:
        raise ValueError(f"apply_lora: no module of the model matches target_modules={cfg.target_modules}")
    dtype = cfg.torch_dtype
    for name, lin in hits:
        parent_name, _, leaf = name.rpartition(".")
        lora = LoRALinear(lin, cfg.r, cfg.alpha, cfg.dropout, dtype, gen)
        model.get_submodule(parent_name).register_module(leaf, lora)
    for bank in banks:
        # A partial bank (an expert-parallel shard loaded alone) gets the whole layer's adapter, drawn
        # as a whole bank's would be (later draws and every expert's init stay rank-independent),
        # reached through the local -> global offset; apply_expert_parallel may slice it.
        lora = ExpertLoRA(bank, cfg.r, cfg.alpha, cfg.dropout, dtype, gen, num_experts=bank.total_experts)
        bank.lora = OffsetExpertLoRA(lora, bank.first_expert) if bank.is_partial else lora
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if cfg.projector_modules:
        from model.vision.lora import apply_projector_lora  # the vision package imports this module

        # Its own generator (seed + 1): adding a projector adapter leaves the text A draws unchanged.
        apply_projector_lora(
            model, cfg.r, cfg.alpha, cfg.dropout, seed + 1, cfg.projector_modules, cfg.torch_dtype
        )
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only, under the model's parameter names (detached, not copied): the unit that
    sync and export move. Linear adapters: `{module}.lora_A.weight` [R, I], `.lora_B.weight` [O, R];
    routed experts: `{bank}.lora.{w1,w2,w3}.lora_A` [E, R, I], `.lora_B` [E, O, R]."""
    out = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    if not out:
        raise ValueError("lora_state_dict: the model has no LoRA adapters (call apply_lora first)")
    return out


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors into the model's adapters. Strict: the names must be exactly the model's
    adapter names and every shape must match; errors list what is wrong and why it usually happens."""
    own = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if not own:
        raise ValueError("load_lora_state_dict: the model has no LoRA adapters (call apply_lora first)")
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    bad_shape = [
        f"{n}: got {tuple(t.shape)}, model has {tuple(own[n].shape)}"
        for n, t in tensors.items()
        if n in own and tuple(t.shape) != tuple(own[n].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensors, e.g. {unexpected[:3]}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} shape mismatches, e.g. {bad_shape[:3]}")
    if problems:
        raise ValueError(
            "load_lora_state_dict: the adapter does not fit this model: " + "; ".join(problems) + ". "
            "The adapter was trained with other target_modules, another rank, or for another base config."
        )
    for n, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"load_lora_state_dict: {n} is {t.dtype}; adapter tensors must be float")
        own[n].copy_(t)


def lora_num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def lora_num_bytes(model: nn.Module) -> int:
    """Bytes of the adapter tensors as held (and as synced / saved in that dtype)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


@dataclass
class MergeError:
    """Squared Frobenius norms summed over a merged group: the exact merged weight W + dW (fp32),
    the adapter's dW, and the stored-minus-exact error (zero unless storage re-quantized)."""

    exact_sq: float = 0.0
    delta_sq: float = 0.0
    error_sq: float = 0.0

    @property
    def rel_error(self) -> float:
        """||stored - exact|| / ||exact||: the quantization error merging added, relative."""
        return math.sqrt(self.error_sq / max(self.exact_sq, 1e-30))

    @property
    def error_over_delta(self) -> float:
        """||stored - exact|| / ||dW||: > 1 means rounding moved the weight more than the adapter did."""
        return math.sqrt(self.error_sq / max(self.delta_sq, 1e-30))


@torch.no_grad()
def merge_lora(model: nn.Module) -> dict[str, MergeError]:
    """Fold every adapter into the base in place and remove the adapters.

    Float linears get W += B A * scaling (computed in fp32, rounded once to W's dtype). A quantized
    expert bank is dequantized one expert at a time, merged and re-quantized with the bank's own
    function (`ExpertBank.quantize_expert_`, the one the checkpoint converter uses); a float bank is
    updated the same way without rounding. Returns, per `{bank}.{proj}` of each merged bank, the
    error that storage added (summed over experts); float linears' only rounding is to W's dtype.
    """
    stats: dict[str, MergeError] = {}
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            m.weight.copy_((m.weight.float() + m.delta_weight()).to(m.weight.dtype))
            parent_name, _, leaf = name.rpartition(".")
            model.get_submodule(parent_name).register_module(leaf, m.to_linear())
        elif isinstance(m, ExpertBank) and isinstance(m.lora, ExpertLoRA):
            lora, m.lora = m.lora, None
            for e in range(m.num_experts):
                w = dict(zip(("w1", "w3", "w2"), m.dequantized(e, torch.float32)))
                delta = {proj: lora.delta_weight(e, proj) for proj in PROJS}
                merged = {proj: w[proj] + delta[proj] for proj in PROJS}
                m.quantize_expert_(e, merged["w1"], merged["w3"], merged["w2"])
                stored = dict(zip(("w1", "w3", "w2"), m.dequantized(e, torch.float32)))
                for proj in PROJS:
                    st = stats.setdefault(f"{name}.{proj}", MergeError())
                    st.exact_sq += merged[proj].square().sum().item()  # SYNC: export-time statistics
                    st.delta_sq += delta[proj].square().sum().item()
                    st.error_sq += (stored[proj] - merged[proj]).square().sum().item()
    return stats
