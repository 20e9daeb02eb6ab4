"""The workers of a GRPO run, as plain classes (Ray actors wrap them; tests build them directly):
`RolloutWorker` (owns an engine), `RewardWorker` (scores completions) and, in rl/learner.py,
`Learner` (base + LoRA, optimizer); the policy builders all three share. Data between them travels
as the typed `Sample` dataclass.

Invariants: the learner and every rollout worker load the *same* NVFP4 base directory and report
`base_fingerprint`, which the driver compares before step 0; after that only `AdapterUpdate`s
(rl/sync.py) move; each `Sample` records the adapter version that generated it, and
`RolloutWorker.generate` refuses to run with a version older than the one it was asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.tokenizer import load_tokenizer
from model.checkpoint import base_fingerprint, directory_fingerprint, load_model
from model.layers.lora import apply_lora, load_lora_state_dict, lora_state_dict
from rl import grpo
from rl.config import TrainConfig
from rl.faults import maybe_fail
from rl.sync import AdapterUpdate

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Sample:
    """One completion of one prompt, from rollout to loss."""

    uid: str  # prompt id (a GRPO group is all samples of one uid in one step)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    adapter_version: int
    text: str = ""
    ground_truth: str = ""
    reward: float = 0.0
    acc: float = 0.0
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)
    # The prompt's images (model.vision.ProcessedImage), in placeholder order: the learner merges
    # the same features the engine saw. The samples of one prompt share the same objects.
    images: tuple = ()
    # Multi-turn trajectories (rollout/multiturn.py): response_ids holds every token after the prompt,
    # the model's and the tools'; `response_mask[i]` is 1 where the model sampled token i (only those
    # are trained: the others get zero loss weight and are not counted in token means); None = all
    # (single turn). `score_text`: what the reward scores (the last model turn without its tool calls);
    # None = `text`.
    response_mask: list[int] | None = None
    score_text: str | None = None

    @property
    def num_model_tokens(self) -> int:
        return len(self.response_ids) if self.response_mask is None else sum(self.response_mask)


def build_policy(
    cfg: TrainConfig, base_dir: str, expert_range: tuple[int, int] | None = None
) -> torch.nn.Module:
    """Base (as stored: NVFP4 experts stay packed) + a fresh LoRA adapter, identical in every process.
    model.family=hf: the Hugging Face model at `base_dir`, NVFP4-quantized on load (rl/hf_policy.py).
    `expert_range`: a DEP rank's routed experts only (`dep_expert_range`); the adapter is the whole one."""
    if cfg.model.family == "hf":
        from rl.hf_policy import build_hf_policy

        lc = cfg.lora
        return build_hf_policy(base_dir, cfg.model.dtype, lc.r, lc.alpha, lc.target_modules, cfg.trainer.seed)
    model = load_model(
        base_dir, device=cfg.trainer.device, dtype=_DTYPES[cfg.model.dtype], expert_range=expert_range
    )
    # The run's cache dtypes go into the model config, which both the engine's cache and the
    # learner's KV simulation (trainer.kv_sim) read: they cannot disagree.
    if cfg.rollout.kv_cache_dtype is not None:
        model.config.kv_cache_dtype = cfg.rollout.kv_cache_dtype
    if cfg.rollout.index_cache_dtype is not None:
        model.config.index_cache_dtype = cfg.rollout.index_cache_dtype
    return apply_lora(model, cfg.lora, seed=cfg.trainer.seed)


def dep_expert_range(base_dir: str, rank: int, world: int) -> tuple[int, int]:
    """The routed experts [lo, hi) that DEP rank `rank` of `world` holds (loads, serves, trains)."""
    from model.config import ModelConfig
    from model.parallel.expert_parallel import expert_ranges

    return expert_ranges(ModelConfig.from_pretrained(base_dir).num_local_experts, world)[rank]


def vllm_settings(
    cfg: TrainConfig, base_dir: str, lora_targets: tuple[str, ...], index: int, eos_token_id: int | None
):
    """The vLLM engine's settings for rollout worker `index`. Every `rollout.<name>` or
    `rollout.vllm_<name>` key and every `lora.<name>` (as `lora_<name>`) that names a VLLMSettings
    field is passed by that name (dataclasses.fields: a key added to both sides needs no line here);
    what the run derives (base directory, PEFT target names, seed, drafter path) is added."""
    from rollout.vllm_backend import VLLMSettings

    names = {f.name for f in dataclasses.fields(VLLMSettings)}
    kwargs = {}
    for f in dataclasses.fields(cfg.rollout):
        name = f.name.removeprefix("vllm_")
        if name in names:
            kwargs[name] = getattr(cfg.rollout, f.name)
    for f in dataclasses.fields(cfg.lora):
        if f"lora_{f.name}" in names:
            kwargs[f"lora_{f.name}"] = getattr(cfg.lora, f.name)
    drafter = cfg.rollout.dspark.drafter
    return VLLMSettings(**{
        **kwargs,
        "model": base_dir,
        "dtype": kwargs["dtype"] or cfg.model.dtype,  # rollout.vllm_dtype null: the model's
        "lora_targets": lora_targets,
        "max_lora_rank": max(32, cfg.lora.r),
        "seed": cfg.trainer.seed + index,
        "drafter": str(Path(drafter) / "dspark") if drafter else None,
        "eos_token_id": eos_token_id,
    })  # fmt: skip


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's LoRA tensors (MiniMax: `lora_state_dict` names; hf: PEFT file names)."""
    return model.adapter_tensors() if hasattr(model, "adapter_tensors") else lora_state_dict(model)


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    if hasattr(model, "load_adapter_tensors"):
        model.load_adapter_tensors(tensors)
    else:
        load_lora_state_dict(model, tensors)


def policy_fingerprint(model: torch.nn.Module, group=None) -> str:
    """The base's fingerprint (collective over `group` when the model holds a shard of its experts)."""
    if hasattr(model, "fingerprint"):
        return model.fingerprint()
    return base_fingerprint(model, group=group)


class RolloutWorker:
    """One engine replica: the native engine over the policy model, or vLLM (rollout.backend=vllm)
    over `base_dir`, which for model.family=hf is the dequantized twin of the learner's NVFP4 base."""

    def __init__(
        self, cfg: TrainConfig, base_dir: str, index: int = 0, expert_range: tuple[int, int] | None = None
    ):
        """`expert_range`: a DEP rank's experts only (rl/replicas.py); the fingerprint is then taken
        by the replica once its group exists."""
        torch.set_num_threads(max(1, cfg.rollout.torch_threads))
        self.cfg, self.index = cfg, index
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.version = 0
        if cfg.rollout.backend == "vllm":
            self._init_vllm(base_dir)
            return
        from rollout.native.engine import NativeEngine

        self.model = build_policy(cfg, base_dir, expert_range).eval()
        self._fingerprint = None if expert_range is not None else base_fingerprint(self.model)
        ds = cfg.rollout.dspark
        self.drafter, self.cotrainer, spec = None, None, None
        if ds.drafter is not None:
            from rollout.dspark import SpecConfig, load_drafter

            # A resumed co-training run continues from its own latest drafter (cotrain_drafter saves
            # every version to output_dir/drafter), not from the shipped one it started with.
            own = Path(cfg.output_dir) / "drafter"
            src = own if ds.cotrain.enabled and cfg.resume and (own / "dspark").is_dir() else ds.drafter
            self.drafter = load_drafter(src, target=self.model, device=self.model.lm_head.weight.device)
            spec = SpecConfig(mode=ds.mode)
            if ds.cotrain.enabled and index == 0:  # worker 0 trains; the driver publishes to the others
                from rollout.dspark.cotrain import CoTrainer

                self.cotrainer = CoTrainer(self.model, self.drafter, ds.cotrain, seed=cfg.trainer.seed)
        self.engine = NativeEngine(
            self.model,
            max_pages=cfg.rollout.max_pages,
            max_batch_tokens=cfg.rollout.max_batch_tokens,
            max_num_seqs=cfg.rollout.max_num_seqs,
            detokenize=self.tokenizer.decode,  # stop strings (a tool call's end marker)
            drafter=self.drafter,
            spec=spec,
            cuda_graphs=cfg.rollout.cuda_graphs,
            compile_decode=cfg.rollout.compile_decode,
            async_decode=cfg.rollout.async_decode,
        )
        self._spec_seen = (0, 0)  # (verification passes, accepted drafts) already reported

    def _init_vllm(self, base_dir: str) -> None:
        from model.adapter import peft_target_modules
        from rollout.vllm_backend import VLLMEngine

        cfg = self.cfg
        if cfg.model.family == "hf":
            from rl.hf_policy import twin_fingerprint

            self._fingerprint = twin_fingerprint(base_dir)
            targets = tuple(cfg.lora.target_modules)
        else:  # vLLM serves the project's checkpoint (GPU builds with MiniMax-M3 support) itself:
            # compared with the learner by the directory's files and dtype, never loaded here
            self._fingerprint = directory_fingerprint(base_dir, _DTYPES[cfg.model.dtype])
            targets = tuple(peft_target_modules(list(cfg.lora.target_modules)))
        eos = self.tokenizer.eos_token_id
        self.engine = VLLMEngine(vllm_settings(cfg, base_dir, targets, self.index, eos))

    def fingerprint(self) -> str:
        return self._fingerprint

    def set_adapter(self, update: AdapterUpdate) -> dict[str, float]:
        tensors = update.tensors
        if self.cfg.rollout.backend == "vllm" and self.cfg.model.family != "hf":
            from model.adapter import to_peft_tensors

            tensors = to_peft_tensors(tensors)
        self.engine.set_adapter(tensors, update.version)
        self.version = update.version
        return dict(getattr(self.engine, "last_sync", {}))

    def shutdown(self) -> None:
        """Stop engine subprocesses (vLLM) before the actor is killed."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        pool = getattr(self, "_pool", None)
        if pool is not None:  # multi-turn tool threads
            pool.shutdown(wait=False, cancel_futures=True)

    def generate(
        self,
        prompts: list,
        n: int,
        temperature: float,
        top_p: float,
        seed: int,
        min_version: int = 0,
        positions: list[int] | None = None,
    ) -> list[Sample]:
        """n samples of each prompt. Seeds derive from (seed, prompt position in the whole step's
        batch: `positions`, default 0..), so a step's rollouts are the same whatever the worker count."""
        from rollout.engine import Request, SamplingParams

        maybe_fail(self.cfg.trainer.fault_injection, self.cfg.output_dir, "rollout.generate", min_version)
        if self.version < min_version:
            raise RuntimeError(
                f"rollout worker {self.index} holds adapter v{self.version} but v{min_version} was required: "
                "a sync was lost; refusing to sample with a stale adapter"
            )
        r = self.cfg.rollout
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            max_tokens=r.max_tokens,
            stop_token_ids=tuple(self.tokenizer.stop_token_ids),
        )
        positions = list(range(len(prompts))) if positions is None else positions
        if r.multi_turn.enabled:
            return self._generate_episodes(prompts, n, params, seed, positions)
        requests, images_of = [], {}
        vision = self._vision_config()
        for i, p in zip(positions, prompts, strict=True):
            if _has_image_parts(p.messages):
                ids, images = self._image_prompt(p, vision)
            else:  # text: the prompt ids are exactly what they were before images existed
                ids, images = self.tokenizer.chat_prompt(p.messages), ()
            images_of[p.uid] = images
            requests.append(Request(tuple(ids), params, n=n, seed=(seed * 1_000_003 + i) % 2**31,
                                    request_id=p.uid, images=images))  # fmt: skip
        completions = self.engine.generate(requests)
        by_uid = {p.uid: p for p in prompts}
        samples = []
        for c in completions:
            p = by_uid[c.request_id]
            samples.append(
                Sample(
                    uid=p.uid,
                    prompt_ids=list(c.prompt_token_ids),
                    response_ids=list(c.token_ids),
                    rollout_logprobs=c.logprobs.tolist(),
                    finish_reason=c.finish_reason,
                    adapter_version=c.adapter_version,
                    text=self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                    ground_truth=p.ground_truth,
                    images=images_of[p.uid],
                )
            )
        return samples

    # ------------------------------------------------------------------ multi-turn
    def _tool_registry(self):
        """The run's tools: the registered ones, with `python` bound to the recipe's sandbox limits."""
        import rollout.tools.calculator  # noqa: F401  (registers the tools)
        import rollout.tools.sandbox as sandbox
        from rollout.tools.registry import REGISTRY, Registry, Tool

        mt = self.cfg.rollout.multi_turn
        limits = sandbox.Limits(cpu_s=mt.python_cpu_s, wall_s=mt.python_wall_s,
                                memory_bytes=mt.python_memory_mb << 20)  # fmt: skip
        registry = Registry()
        for name in mt.tools:
            t = REGISTRY.tools[name]
            if name == "python":
                t = Tool(t.name, t.description, t.parameters, lambda code: sandbox.run_python(code, limits))
            registry.add(t)
        return registry

    def _generate_episodes(
        self, prompts: list, n: int, params, seed: int, positions: list[int]
    ) -> list[Sample]:
        """n multi-turn trajectories of each prompt (rollout/multiturn.py) as Samples: response_ids
        every token after the prompt, response_mask the model's, score_text the final answer."""
        import concurrent.futures as cf

        from common.data import text_only
        from common.tool_calls import TOOL_CALL_END
        from rollout import multiturn
        from rollout.tools.env import ToolEnv

        mt, r = self.cfg.rollout.multi_turn, self.cfg.rollout
        if getattr(self, "_tools", None) is None:
            self._tools = self._tool_registry()
            self._pool = cf.ThreadPoolExecutor(mt.tool_workers, thread_name_prefix="tool")
        limits = multiturn.TurnLimits(max_turns=mt.max_turns, max_tokens_per_turn=mt.max_tokens_per_turn or
                                      r.max_tokens, max_context=mt.max_context,
                                      deterministic=mt.deterministic)  # fmt: skip
        params = dataclasses.replace(params, stop=(TOOL_CALL_END,))
        groups = []
        for i, p in zip(positions, prompts, strict=True):
            users = [m for m in text_only(p.messages) if m.get("role") == "user"]
            row = {"prompt": users[-1]["content"], "answer": p.ground_truth}
            envs = [
                ToolEnv(list(mt.tools), self._tools, max_turns=mt.max_turns,
                        max_calls_per_turn=mt.max_calls_per_turn, system_prompt=mt.system_prompt)
                for _ in range(n)
            ]  # fmt: skip
            messages = [env.reset(row) for env in envs][-1]  # every env is reset; their first messages agree
            ids = self.tokenizer.chat_prompt(messages, envs[0].tools if mt.show_tools else ())
            groups.append(
                multiturn.EpisodeGroup(p.uid, tuple(ids), envs, params, (seed * 1_000_003 + i) % 2**31)
            )
        if r.backend == "vllm":
            backend = multiturn.HistoryTurns(self.engine, detokenize=self.tokenizer.decode)
        else:
            backend = multiturn.NativeTurns(self.engine)
        trajs = multiturn.run_episodes(backend, groups, self.tokenizer, limits, self._pool)
        by_uid = {p.uid: p for p in prompts}
        samples = []
        for t in trajs:
            p = by_uid[t.request_id]
            extra = {"turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                     "tool_malformed": t.malformed, "tool_seconds": t.tool_seconds,
                     "sandbox_timeouts": t.sandbox_timeouts,
                     "multi_turn_finish": t.finish_reason}  # fmt: skip
            if t.env_error:
                extra["env_error"] = t.env_error
            samples.append(Sample(
                uid=p.uid, prompt_ids=t.prompt_ids, response_ids=t.token_ids, rollout_logprobs=t.logprobs,
                finish_reason="length" if t.finish_reason in ("length", "max_turns") else "stop",
                adapter_version=min(t.adapter_versions) if t.adapter_versions else self.version,
                text=self.tokenizer.decode(t.token_ids, skip_special_tokens=True),
                ground_truth=p.ground_truth, extra=extra, response_mask=t.is_model, score_text=t.final_text,
            ))  # fmt: skip
        return samples

    def _vision_config(self):
        """The policy's VisionConfig (None: text-only model or the vLLM backend)."""
        vision = getattr(getattr(self, "model", None), "vision", None)
        return None if vision is None else vision.config

    def _image_prompt(self, p, vision) -> tuple[list[int], tuple]:
        """Prompt ids with image placeholders and the processed images of one image prompt."""
        from model.vision import ImageInputError, chat_to_ids_and_images

        if self.cfg.rollout.backend != "native":
            raise ValueError(
                f"prompt {p.uid!r} has images but rollout.backend={self.cfg.rollout.backend!r} does not "
                "take image inputs; use rollout.backend=native"
            )
        if vision is None:
            raise ValueError(
                f"prompt {p.uid!r} has image content parts but the model has no vision tower; use a "
                "minimax_m3_vl checkpoint or model.preset=tiny-vl"
            )
        try:
            chat = chat_to_ids_and_images(p.messages, self.tokenizer, vision)
        except ImageInputError as e:
            raise ImageInputError(f"prompt {p.uid!r}: {e}") from e
        return chat.input_ids, tuple(chat.images)

    # ------------------------------------------------------------------ DSpark
    def spec_stats(self) -> dict[str, float]:
        """Verification passes and accepted drafts since the last call (this step's speculation)."""
        s = self.engine.stats()
        steps, acc = s.spec_steps - self._spec_seen[0], s.spec_accepted - self._spec_seen[1]
        self._spec_seen = (s.spec_steps, s.spec_accepted)
        return {"steps": float(steps), "accepted": float(acc)}

    def cotrain_drafter(self, samples: list[Sample]) -> tuple[dict[str, float], dict | None, int]:
        """Hand this step's rollouts to the drafter's co-trainer (worker 0 only); returns (metrics,
        the drafter's new weights for the other engines or None when this step trained nothing,
        drafter version). A new version is also saved to `output_dir/drafter` (served beside the
        exported adapter)."""
        from rollout.dspark import save_drafter
        from rollout.dspark.cotrain import drafter_state

        seqs = [(s.prompt_ids + s.response_ids, len(s.prompt_ids)) for s in samples]
        before = self.cotrainer.version
        metrics = self.cotrainer.update(seqs)
        if self.cotrainer.version == before:
            return metrics, None, before
        save_drafter(self.drafter, Path(self.cfg.output_dir) / "drafter")
        return metrics, drafter_state(self.drafter), self.cotrainer.version

    def set_drafter(self, state: dict, version: int) -> None:
        from rollout.dspark.cotrain import load_drafter_state

        load_drafter_state(self.drafter, state)
        self.drafter_version = version

    def stats(self) -> dict:
        s = self.engine.stats()
        return {
            "tokens_generated": s.tokens_generated,
            "tokens_per_s": s.tokens_per_s,
            "preemptions": s.preemptions,
        }


class RewardWorker:
    """Scores completions in a pool of scorer processes with a per-sample timeout: a scorer that
    hangs or raises gives -1 for that sample only."""

    def __init__(self, cfg: TrainConfig, processes: int = 1):
        from rl.rewards import ScoringPool

        self.cfg = cfg
        self.pool = ScoringPool(num_workers=processes)

    def ping(self) -> bool:
        return True

    def score(self, samples: list[Sample], step: int = -1) -> list[Sample]:
        maybe_fail(self.cfg.trainer.fault_injection, self.cfg.output_dir, "reward.score", step)
        results = self.pool.score(
            [s.text if s.score_text is None else s.score_text for s in samples],
            [s.ground_truth for s in samples],
            timeout_s=self.cfg.reward.timeout_s,
            batch_timeout_s=self.cfg.reward.batch_timeout_s,
        )
        r = self.cfg.reward
        shaping = [0.0] * len(samples)
        if r.overlong_buffer > 0:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            shaping = grpo.overlong_penalty(
                lengths, self.cfg.rollout.max_tokens, r.overlong_buffer, r.overlong_penalty
            ).tolist()
        for s, res, extra in zip(samples, results, shaping, strict=True):
            s.acc = float(res["acc"])
            s.reward = float(res["score"]) + extra
            if "error" in res:
                s.extra["reward_error"] = res["error"]
                s.extra["reward_error_kind"] = res.get("error_kind", "exception")
        return samples


def _has_image_parts(messages) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") == "image_url" for part in m["content"])
        for m in messages
    )
