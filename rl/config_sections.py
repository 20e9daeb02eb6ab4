"""The sections of a training config: one validated dataclass per component (model, data, rollout,
reward, algorithm, optimizer, trainer, tracking, Ray) and the Literal choices they take.

A component whose config is torch-free is its section as it is (`lora`: LoRAConfig,
`rollout.dspark.cotrain`: CoTrainConfig); every field is documented in its section's docstring.
Invariants: each section validates itself in `__post_init__` with messages naming `section.key` and
a valid value; rl/config.py composes recipes and checks what spans sections.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from model.config import PRESETS, ModelConfig
from rollout.dspark.cotrain_config import CoTrainConfig

# Design notes (moved from the module docstring)
# What: the schema `rl.config.TrainConfig` nests (recipes and overrides are composed and merged there,
# in rl/config.py, which also checks the constraints that span sections). Every field is documented in
# its section's docstring; the README's recipe table names the ones most runs change.
#
# Why a module of its own: the schema is most of the config code and grows with each capability (a new
# key, its validation and its error message live together here), while composing recipes does not.
#
# Invariants: every section validates itself in `__post_init__` with a `ValueError` that names the
# key (`section.key`) and the fix; nothing here imports torch (loading a config must stay cheap).

ModelDtype = Literal["fp32", "bf16"]
DataKind = Literal["arithmetic", "dapo_math", "geo_vision"]
RolloutBackend = Literal["native", "vllm"]
ModelFamily = Literal["minimax_m3", "hf"]
VLLMSync = Literal["auto", "tensors", "ramdir"]
Placement = Literal["none", "pack", "spread"]
SpecMode = Literal["fixed", "scheduled"]
CacheDtype = Literal["fp32", "bf16", "fp8", "nvfp4", "nvfp4_4over6"]
RewardKind = Literal["math_dapo"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
Device = Literal["cpu", "cuda"]
# "none" = no model parallelism inside the replica / learner group (learners are still data parallel);
# "dp" is the old spelling of "none" for trainer.learner_parallel (accepted with a FutureWarning).
LearnerParallel = Literal["none", "dep", "dp"]
EngineParallel = Literal["none", "dep", "dcp"]
TrackingMode = Literal["offline", "online", "disabled"]
WarmupTask = Literal["arithmetic", "tools"]

_WANDB_ENV_MODES: dict[str, TrackingMode] = {
    "offline": "offline", "dryrun": "offline", "online": "online", "run": "online", "disabled": "disabled",
}  # fmt: skip


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def at_least(obj: Any, section: str, lo: float, *names: str) -> None:
    """Each named field (None = unset, allowed) must be >= lo."""
    for name in names:
        value = getattr(obj, name)
        require(value is None or value >= lo, f"{section}.{name} must be >= {lo}, got {value}")


# ---------------------------------------------------------------------------------------- sections
@dataclass
class ModelSection:
    """The policy's base. `checkpoint` (a directory written by model/checkpoint.py) wins over
    `preset` (model.config presets, random init) when both are set; `overrides` replaces
    ModelConfig fields after either (e.g. `model.overrides.num_hidden_layers=2`)."""

    # "minimax_m3": the project's model (model/modeling.py). "hf": a Hugging Face causal LM (Qwen3,
    # Llama, ...) from `checkpoint`, NVFP4-quantized on load (model/hf_nvfp4.py), served by vLLM only.
    family: ModelFamily = "minimax_m3"
    preset: str | None = "tiny"
    checkpoint: str | None = None
    dtype: ModelDtype = "fp32"
    overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "byte"  # "byte" (common/tokenizer.py) or a Hugging Face tokenizer name/path
    # Build `checkpoint` with the arithmetic warm-up (rollout/bases/warmup.py) when it does not exist yet: the
    # quickstart's base is made once on the user's machine and cached, not downloaded. `warmup_task`
    # picks the builder: "arithmetic" (the quickstart) or "tools" (quickstart_tools: the calculator's
    # call format, rollout/bases/tools_warmup.py).
    warmup: bool = False
    warmup_task: WarmupTask = "arithmetic"

    def __post_init__(self) -> None:
        require(
            self.preset is not None or self.checkpoint is not None,
            "model: set model.preset or model.checkpoint (both are null)",
        )
        require(
            self.preset is None or self.preset in PRESETS,
            f"model.preset: unknown preset {self.preset!r}; valid presets: {list(PRESETS)}",
        )
        valid = [f.name for f in dataclasses.fields(ModelConfig)]
        unknown = [k for k in self.overrides if k not in valid]
        require(
            not unknown,
            f"model.overrides: unknown ModelConfig field(s) {unknown}; valid fields: {valid}",
        )
        require(bool(self.tokenizer), "model.tokenizer must be 'byte' or a tokenizer name/path")
        require(
            self.family != "hf" or self.checkpoint is not None,
            "model.family=hf needs model.checkpoint=<Hugging Face model directory> "
            "(presets are MiniMax-M3 only)",
        )


@dataclass
class DataSection:
    """Prompts. `dapo_math`: the hub datasets `hub_train` / `hub_eval` first, falling back to the
    local parquet files `train_path` / `eval_path` (verl schema) when the hub is unreachable.
    `geo_vision`: image+text math prompts in the Geometry3K format (common/geo_data.py), the same hub-then-
    local order, reading the hub splits `hub_train_split` / `hub_eval_split`; rows with more than
    `max_images` images or an image over `max_image_pixels` (width x height) are skipped.
    `arithmetic`: a synthetic dataset (common/data.py) of `num_train` / `num_eval` problems over
    integers in [0, max_operand] with the operators `ops`, in the same prompt/answer format; `digits`
    [da, db] instead draws a with exactly da digits and b with db (e.g. [3, 2]: 123*45)."""

    kind: DataKind = "arithmetic"
    train_path: str | None = None
    eval_path: str | None = None
    hub_train: str | None = None
    hub_eval: str | None = None
    # geo_vision only (DAPO-Math-17K and AIME-2024 on the hub have a single "train" split).
    hub_train_split: str = "train"
    hub_eval_split: str = "test"
    max_images: int = 1
    max_image_pixels: int = 1 << 24  # common.data.MAX_IMAGE_PIXELS
    max_prompt_tokens: int = 512
    num_train: int = 4096
    num_eval: int = 128
    max_operand: int = 50
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    digits: list[int] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(self, "data", 1, "max_prompt_tokens", "max_images", "max_image_pixels")
        require(
            bool(self.hub_train_split) and bool(self.hub_eval_split),
            "data.hub_train_split / data.hub_eval_split must name a split (e.g. train, test)",
        )
        if self.kind == "arithmetic":
            at_least(self, "data", 1, "num_train", "max_operand")
            at_least(self, "data", 0, "num_eval")
            require(
                self.digits is None or (len(self.digits) == 2 and all(1 <= d <= 9 for d in self.digits)),
                f"data.digits must be null or two digit counts in [1, 9] (of a and of b), got {self.digits}",
            )
            bad = [op for op in self.ops if op not in ("+", "-", "*")]
            require(
                bool(self.ops) and not bad, f"data.ops must be a non-empty subset of [+, -, *]: {self.ops}"
            )
        else:
            require(
                self.train_path is not None or self.hub_train is not None,
                f"data: kind={self.kind!r} needs data.hub_train or data.train_path",
            )


@dataclass
class DSparkSection:
    """DSpark speculative decoding in the native engine (rollout/dspark). `drafter`: a directory
    holding `dspark/` (python -m rollout.dspark.train); None = no speculation. `mode`: how many
    drafts are verified per step ("scheduled" by the drafter's confidence, or all: "fixed").
    `cotrain` is the co-trainer's own config (rollout/dspark/cotrain_config.py): with
    `cotrain.enabled` the drafter is distilled on the latest rollouts and published to every engine,
    so acceptance follows the changing policy (rollout/dspark/cotrain.py)."""

    drafter: str | None = None
    mode: SpecMode = "scheduled"
    cotrain: CoTrainConfig = field(default_factory=CoTrainConfig)

    def __post_init__(self) -> None:
        require(
            not self.cotrain.enabled or self.drafter is not None,
            "rollout.dspark.cotrain.enabled=true needs rollout.dspark.drafter=DIR (a drafter to start "
            "from; python -m rollout.dspark.train builds one)",
        )


@dataclass
class MultiTurnSection:
    """Multi-turn tool-use episodes (rollout/multiturn.py, rollout/tools/): with `enabled`, every rollout
    is a trajectory of model turns and tool turns in a `ToolEnv` over the registered `tools`
    ("calculator", "python"). A turn ends at the tool-call end marker or EOS, at `max_tokens_per_turn`
    tokens (null: rollout.max_tokens); a trajectory has at most `max_turns` model turns and
    `max_context` tokens (prompt included) and runs at most `max_calls_per_turn` calls per turn.
    `show_tools` puts the tools' schemas in the first prompt (the chat template's tools list);
    `system_prompt` (when non-empty) is the episode's system message. `tool_workers` threads per rollout
    worker run the environment steps while the engine generates; `deterministic` applies each reply at
    a fixed engine step, so a run replays exactly (resume). The `python` tool runs in a sandbox process
    per call with `python_cpu_s` CPU seconds, `python_wall_s` wall seconds and `python_memory_mb` of
    address space. Only model tokens are trained; tool tokens have zero loss weight."""

    enabled: bool = False
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_context: int = 2048
    max_calls_per_turn: int = 4
    show_tools: bool = True
    system_prompt: str = ""
    tool_workers: int = 8
    deterministic: bool = True
    python_cpu_s: int = 2
    python_wall_s: float = 5.0
    python_memory_mb: int = 512

    def __post_init__(self) -> None:
        section = "rollout.multi_turn"
        at_least(self, section, 1, "max_turns", "max_tokens_per_turn", "max_context", "max_calls_per_turn")
        at_least(self, section, 1, "tool_workers", "python_cpu_s", "python_memory_mb")
        require(self.python_wall_s > 0, f"{section}.python_wall_s must be > 0, got {self.python_wall_s}")
        known = ("calculator", "python")
        bad = [t for t in self.tools if t not in known]
        require(
            bool(self.tools) and not bad,
            f"{section}.tools must be a non-empty list of registered tools {list(known)}, got {self.tools}",
        )


@dataclass
class RolloutSection:
    """Generation. `n_samples` is G (completions per prompt). `kv_cache_dtype` / `index_cache_dtype`
    None = the model config's. Native engine: `max_pages` pages of one MSA block each (per process:
    per rank of a multi-rank replica), `max_batch_tokens` per forward, `max_num_seqs` running
    sequences. vLLM: `tensor_parallel_size`, `gpu_memory_utilization` and `kv_cache_memory_bytes`.
    `num_gpus` is the Ray GPU request per worker (per rank), `torch_threads` its CPU threads.
    `engine_parallel` != "none" makes each of the `num_workers` replicas `engine_ranks` Ray actors (one
    process and `num_gpus` GPUs each) in one torch.distributed group (rl/replicas.py):
      - "dep" (rollout/native/dep.py): attention data parallel (each rank its own requests and KV
        cache), routed experts sharded over the ranks, tokens exchanged by all-to-all;
      - "dcp" (rollout/native/dcp.py): decode-context parallel: every rank holds the whole model and
        runs every request but keeps only every W-th KV / index-key page of each sequence, so a replica
        of W ranks with `max_pages` each holds W x the context of one `max_pages` engine;
    "none" = one process per replica."""

    backend: RolloutBackend = "native"
    num_workers: int = 1
    n_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    kv_cache_dtype: CacheDtype | None = None
    index_cache_dtype: CacheDtype | None = None
    max_pages: int = 512
    max_batch_tokens: int = 512
    max_num_seqs: int = 64
    num_gpus: float = 0.0
    engine_parallel: EngineParallel = "none"
    engine_ranks: int = 1
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_bytes: int | None = None  # vLLM: an explicit KV cache size (null: from the fraction)
    torch_threads: int = 1
    # Native engine on CUDA: replay all-decode steps from CUDA graphs captured per batch bucket
    # (rollout/native/runner.py); null = on for CUDA engines, off on CPU.
    cuda_graphs: bool | None = None
    # Native engine: torch.compile the padded decode pass (before capture on CUDA): 1.4-2.1x faster
    # decode steps on the H200 at `small` (benchmarks/RESULTS.md, 2026-12-02) for a one-time compile
    # of 0.5-3 min; on the CPU it also turns on the padded (static) decode path.
    compile_decode: bool = False
    # Native engine: launch each padded all-decode step before the previous one's tokens are read back
    # (the host's bookkeeping overlaps the device; tokens and log-probs unchanged); null = on wherever
    # the padded path runs (graphs or compile_decode), false = read back every step first.
    async_decode: bool | None = None
    # vLLM backend only: how adapters reach vLLM ("auto": in memory where tested, else a RAM-backed
    # directory), the dtype it computes in (None = model.dtype) and its context length; its DSpark
    # drafter is rollout.dspark.drafter.
    dspark: DSparkSection = field(default_factory=DSparkSection)
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    vllm_sync: VLLMSync = "auto"
    vllm_dtype: ModelDtype | None = None
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        at_least(self, "rollout", 1, "num_workers", "n_samples", "max_tokens", "max_pages", "max_model_len")
        at_least(
            self, "rollout", 1, "max_batch_tokens", "max_num_seqs", "tensor_parallel_size", "torch_threads"
        )
        at_least(self, "rollout", 1, "engine_ranks")
        if self.engine_parallel == "none":
            require(
                self.engine_ranks == 1,
                f"rollout.engine_ranks={self.engine_ranks} needs rollout.engine_parallel=dep or dcp (ranks "
                "per replica); with engine_parallel=none set rollout.engine_ranks=1",
            )
        else:
            mode = f"rollout.engine_parallel={self.engine_parallel}"
            require(
                self.engine_ranks >= 2,
                f"{mode} needs rollout.engine_ranks >= 2 (got {self.engine_ranks}); "
                "for one process per replica set rollout.engine_parallel=none",
            )
            require(
                self.backend == "native",
                f"{mode} is a native-engine layout (rollout.backend={self.backend!r}): "
                "set rollout.backend=native, or rollout.engine_parallel=none for vLLM",
            )
            require(
                self.dspark.drafter is None,
                f"{mode} does not run DSpark speculation yet (its draft and verify passes are "
                "single-rank): set rollout.dspark.drafter=null or rollout.engine_parallel=none",
            )
        if self.compile_decode:
            require(
                self.backend == "native" and self.engine_parallel == "none" and self.dspark.drafter is None,
                "rollout.compile_decode=true compiles the native engine's padded decode pass, which runs "
                "only without DSpark and DEP / DCP: set rollout.compile_decode=false, or "
                "rollout.backend=native rollout.engine_parallel=none rollout.dspark.drafter=null",
            )
        if self.async_decode:
            require(
                self.backend == "native" and self.engine_parallel == "none" and self.dspark.drafter is None,
                "rollout.async_decode=true launches the native engine's padded decode steps ahead, which "
                "run only without DSpark and DEP / DCP: set rollout.async_decode=null (on where it can be)",
            )
        at_least(self, "rollout", 0, "temperature", "num_gpus")
        if self.multi_turn.enabled:
            mt = "rollout.multi_turn.enabled=true"
            require(
                self.dspark.drafter is None,
                f"{mt} does not run DSpark speculation yet (parked sequences and the drafter's cache are "
                "not wired together): set rollout.dspark.drafter=null or rollout.multi_turn.enabled=false",
            )
            require(
                self.engine_parallel == "none",
                f"{mt} needs one process per replica (rollout.engine_parallel=none); DEP / DCP replicas do "
                "not continue parked sequences yet",
            )
        require(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "rollout.kv_cache_memory_bytes must be a positive byte count or null, got "
            f"{self.kv_cache_memory_bytes}",
        )


@dataclass
class RewardSection:
    """Scoring: verl's math_dapo (+1 / -1 on the last "Answer:" line) in `num_workers` processes with
    a per-sample `timeout_s` and, when set, `batch_timeout_s` for a worker's whole batch (samples
    still unscored then get -1 and count as `reward/errors/timeout`). DAPO overlong shaping: a
    response longer than max_tokens - overlong_buffer loses up to `overlong_penalty`, linearly over
    the buffer (0 = off)."""

    kind: RewardKind = "math_dapo"
    num_workers: int = 1
    timeout_s: float = 5.0
    batch_timeout_s: float | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        at_least(self, "reward", 1, "num_workers")
        at_least(self, "reward", 0, "overlong_buffer", "overlong_penalty")
        require(self.timeout_s > 0, f"reward.timeout_s must be > 0, got {self.timeout_s}")
        require(
            self.batch_timeout_s is None or self.batch_timeout_s > 0,
            f"reward.batch_timeout_s must be null or > 0, got {self.batch_timeout_s}",
        )


@dataclass
class AlgoSection:
    """GRPO / DAPO. `batch_prompts` (B) prompts x G samples per step; clip range [1 - eps_low,
    1 + eps_high]; `kl_coef` > 0 adds the k3 KL to the base; `tis_cap` caps the token-level
    importance ratio learner/rollout (None = off); dynamic sampling drops zero-variance groups and
    regenerates up to `max_regen_rounds` times. `mini_batch_prompts` splits a step's batch into
    optimizer updates of that many prompts' groups (None = one update per step, as GRPO's default;
    DAPO uses 32 of 512), repeated `ppo_epochs` times."""

    batch_prompts: int = 8
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    tis_cap: float | None = 2.0
    dynamic_sampling: bool = True
    max_regen_rounds: int = 3
    ppo_epochs: int = 1
    mini_batch_prompts: int | None = None

    def __post_init__(self) -> None:
        at_least(self, "algo", 1, "batch_prompts", "ppo_epochs")
        at_least(self, "algo", 0, "eps_high", "kl_coef", "max_regen_rounds")
        require(0 <= self.eps_low < 1, f"algo.eps_low must be in [0, 1), got {self.eps_low}")
        require(self.tis_cap is None or self.tis_cap > 0, f"algo.tis_cap must be > 0 or null: {self.tis_cap}")
        mb = self.mini_batch_prompts
        require(
            mb is None or (mb >= 1 and self.batch_prompts % mb == 0),
            f"algo.mini_batch_prompts must divide algo.batch_prompts={self.batch_prompts}, got {mb}",
        )


@dataclass
class OptimSection:
    """AdamW over the adapter parameters only; linear warm-up over `warmup_steps` trainer steps (the
    schedule advances once per GRPO step, as verl's, however many mini-batch updates a step makes),
    then constant; global grad-norm clipping at `grad_clip` (0 = off)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        at_least(self, "optim", 0, "weight_decay", "warmup_steps", "grad_clip")
        require(all(0 <= b < 1 for b in self.betas), f"optim.betas must be in [0, 1), got {self.betas}")
        require(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")


@dataclass
class TrainerSection:
    """The step loop. `eval_every` / `save_every` in steps (0 = never); evaluation samples
    `eval_n_samples` completions per eval prompt (avg@k) at `eval_temperature` / `eval_top_p`.
    `micro_batch_size` sequences per learner forward/backward. `kv_sim` makes the learner's attention
    see K/V through the engine's cache quantization. `num_learners` learner actors (data parallel:
    each takes a shard of every mini-batch, LoRA gradients are all-reduced, so all hold the same
    adapter) request `num_gpus` each; `learner_parallel=dep` also shards the routed experts and their
    adapters over the learners (attention data parallel, MoE expert parallel: tokens exchanged by
    all-to-all; model/parallel/dep_learner.py); `torch_threads` CPU threads per learner;
    `keep_checkpoints` is how many step checkpoints stay."""

    total_steps: int = 100
    micro_batch_size: int = 8
    eval_every: int = 10
    eval_n_samples: int = 1
    eval_temperature: float = 0.0
    eval_top_p: float = 1.0
    save_every: int = 50
    keep_checkpoints: int = 3
    seed: int = 0
    gradient_checkpointing: bool = False
    device: Device = "cpu"
    kv_sim: bool = False
    num_learners: int = 1
    learner_parallel: LearnerParallel = "none"
    num_gpus: float = 0.0
    torch_threads: int = 1
    # Reliability: a rollout/reward actor that dies is restarted up to `max_restarts` times (its
    # work re-run, the current adapter re-sent); `max_nonfinite_steps` consecutive NaN/inf losses or
    # gradients abort the run (each one skips its optimizer step); `fault_injection` is for the
    # reliability tests only (rl/faults.py).
    max_restarts: int = 3
    max_nonfinite_steps: int = 3
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        at_least(self, "trainer", 1, "total_steps", "micro_batch_size", "eval_n_samples")
        at_least(
            self, "trainer", 1, "keep_checkpoints", "num_learners", "torch_threads", "max_nonfinite_steps"
        )
        at_least(self, "trainer", 0, "max_restarts")
        if self.learner_parallel == "dp":
            warnings.warn(
                "trainer.learner_parallel=dp is deprecated: write trainer.learner_parallel=none (data-"
                "parallel learners without expert parallelism; the spelling rollout.engine_parallel uses)",
                FutureWarning,
                stacklevel=2,
            )
            self.learner_parallel = "none"
        from rl.faults import parse as parse_faults

        parse_faults(self.fault_injection)
        at_least(self, "trainer", 0, "eval_every", "save_every", "eval_temperature", "num_gpus")
        require(0 < self.eval_top_p <= 1, f"trainer.eval_top_p must be in (0, 1], got {self.eval_top_p}")


@dataclass
class TrackingSection:
    """Weights & Biases. `mode` None = WANDB_MODE if set, else online iff WANDB_API_KEY is set, else
    offline (see `resolved_mode`); `log_samples` completions per step go to the samples table."""

    mode: TrackingMode | None = None
    project: str = "nvfp4-rl"
    entity: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    log_samples: int = 8

    def __post_init__(self) -> None:
        require(bool(self.project), "tracking.project must be a non-empty string")
        at_least(self, "tracking", 0, "log_samples")

    def resolved_mode(self) -> TrackingMode:
        """`mode` if set; else W&B's own WANDB_MODE variable if set; else online iff WANDB_API_KEY."""
        if self.mode is not None:
            return self.mode
        env = _WANDB_ENV_MODES.get(os.environ.get("WANDB_MODE", "").strip().lower())
        if env is not None:
            return env
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"


@dataclass
class RaySection:
    """`address` None starts an embedded local Ray instance; "auto" or host:port joins a cluster.
    `placement`: "none" lets Ray place actors freely; "pack" / "spread" reserve one placement-group
    bundle per learner and rollout worker (their `num_gpus`, plus `bundle_cpus` CPUs) first, so a
    run either gets its whole layout or waits, and learners / engines land together ("pack") or on
    different nodes where possible ("spread")."""

    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    placement: Placement = "none"
    bundle_cpus: float = 0.01

    def __post_init__(self) -> None:
        at_least(self, "ray", 1, "num_cpus")
        at_least(self, "ray", 0, "num_gpus")
        require(
            self.bundle_cpus > 0,
            f"ray.bundle_cpus must be > 0 (Ray bundles need a resource), got {self.bundle_cpus}",
        )
