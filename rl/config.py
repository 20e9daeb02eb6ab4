"""Training configuration: a recipe (YAML) plus dotted overrides -> one validated `TrainConfig`.

What: `load_config(recipe, overrides)` composes `recipes/<recipe>.yaml` (with `defaults:` chains)
and `key.sub=value` overrides over the sections of rl/config_sections.py, checks the constraints that
span sections, and `save_config` writes the resolved config to every run directory. Why OmegaConf
structured configs: the dataclasses are the schema, so values convert to declared types on merge.
Invariants: an unknown key or a bad value is an error naming the key and the fix; renamed keys load
with a warning naming the new one.
"""

from __future__ import annotations

import dataclasses
import time
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.config import ModelConfig
from model.layers.lora_config import LoRAConfig
from rl.config_sections import (
    AlgoSection,
    DataSection,
    ModelSection,
    OptimSection,
    RaySection,
    RewardSection,
    RolloutSection,
    TrackingSection,
    TrainerSection,
    require,
)

# Design notes (moved from the module docstring)
# What: one dataclass per component (model, LoRA, data, rollout, reward, algorithm, optimizer,
# trainer, tracking, Ray; rl/config_sections.py), nested in `TrainConfig`, which checks the constraints
# that span sections; `load_config(recipe, overrides)` composes
# `recipes/<recipe>.yaml` (a recipe may start with `defaults: [other_recipe, ...]`, merged first, in
# order) with `key.sub=value` overrides; `save_config` / `config_from_yaml` write and read back the
# resolved config that every run directory keeps as `config.yaml`.
#
# Why OmegaConf structured configs: the dataclasses are the schema, so YAML and command-line values
# are converted to the declared type on merge (`trainer.total_steps=5` is an int, `lora.target_modules=
# [q_proj,v_proj]` a list of str, `model.checkpoint=null` None) and Literal modes are checked against
# their choices, with no hand-written parser.
#
# Invariants:
# - An unknown recipe, section or key is a `ValueError` naming it and listing the valid choices (keys
#   of that section); a value of the wrong type is a `ValueError` naming the key and the expected type.
#   `model.overrides` is the one open dict; its keys must be `model.config.ModelConfig` fields.
# - Every section validates itself in `__post_init__`; `TrainConfig.__post_init__` checks the
#   cross-section constraints. A `TrainConfig` that exists is valid.
# - `config_from_yaml(path)` of `save_config(cfg, path)` equals `cfg`.

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# Keys renamed after recipes were written: the old spelling still works (recipes, overrides, saved
# configs) with a FutureWarning naming the new key. `rollout.dspark.cotrain` is the old switch only
# when given a bool: it is now the co-trainer's own section (rollout.dspark.cotrain_config).
RENAMED_KEYS = {
    "rollout.dspark.cotrain": "rollout.dspark.cotrain.enabled",
    **{f"rollout.dspark.cotrain_{k}": f"rollout.dspark.cotrain.{k}" for k in ("steps", "lr", "every",
                                                                             "replay_steps", "focus")},
}  # fmt: skip


@dataclass
class TrainConfig:
    """Everything one run needs. `output_dir` None is filled by `load_config` with
    `runs/<recipe>-<YYYYmmdd-HHMMSS>`; `resume` is None, "auto" (latest valid checkpoint under
    output_dir, if any) or a checkpoint directory."""

    recipe: str = "custom"
    output_dir: str | None = None
    resume: str | None = None
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # the adapter's own config is the section
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        require(
            self.reward.overlong_buffer < self.rollout.max_tokens,
            f"reward.overlong_buffer ({self.reward.overlong_buffer}) must be < rollout.max_tokens "
            f"({self.rollout.max_tokens})",
        )
        require(self.resume != "", "resume must be null, 'auto' or a checkpoint path (got '')")
        require(
            self.model.family != "hf" or self.rollout.backend == "vllm",
            "model.family=hf runs on the vLLM backend only (the native engine serves MiniMax-M3): "
            "set rollout.backend=vllm",
        )
        require(
            not self.lora.projector_modules
            or (self.rollout.backend == "native" and self.model.family == "minimax_m3"),
            "lora.projector_modules adapts the vision projector, which only the native engine serves with "
            "an adapter: set rollout.backend=native (model.family=minimax_m3) or lora.projector_modules=[]",
        )
        require(
            self.trainer.learner_parallel == "none" or self.model.family == "minimax_m3",
            "trainer.learner_parallel=dep shards the MiniMax-M3 MoE experts; model.family=hf has none: "
            "use trainer.learner_parallel=none",
        )
        if self.rollout.engine_parallel != "none":
            self._check_parallel_engine()
        if self.rollout.multi_turn.enabled:
            mt = "rollout.multi_turn.enabled=true"
            require(
                self.reward.overlong_buffer == 0,
                f"{mt}: DAPO overlong shaping is defined on one completion's length; set "
                "reward.overlong_buffer=0 (the turn and context limits bound a trajectory)",
            )
            require(
                self.data.kind != "geo_vision",
                f"{mt} takes text prompts; data.kind=geo_vision has images: use data.kind=arithmetic or "
                "dapo_math, or rollout.multi_turn.enabled=false",
            )
        if self.trainer.device == "cpu":
            require(
                self.rollout.num_gpus == 0 and self.trainer.num_gpus == 0,
                "trainer.device=cpu but rollout.num_gpus / trainer.num_gpus ask for GPUs; "
                "set trainer.device=cuda or the GPU counts to 0",
            )

    def _check_parallel_engine(self) -> None:
        """rollout.engine_parallel=dep shards routed experts: the model must have them, evenly.
        rollout.engine_parallel=dcp spreads the MSA KV / index-key pages: the model must have sparse
        attention layers, and no vision tower (image prompts are untested through a DCP replica)."""
        mode, ranks = self.rollout.engine_parallel, self.rollout.engine_ranks
        what = "shards the MiniMax-M3 MoE experts" if mode == "dep" else "splits MiniMax-M3 sparse attention"
        require(
            self.model.family == "minimax_m3",
            f"rollout.engine_parallel={mode} {what}; model.family=hf has none: "
            "use rollout.engine_parallel=none",
        )
        # The checkpoint's config when it exists (warm-up builds a missing one from the preset).
        ckpt = Path(self.model.checkpoint) if self.model.checkpoint else None
        if ckpt is not None and (ckpt / "config.json").is_file():
            mcfg, where = ModelConfig.from_pretrained(ckpt), f"model.checkpoint={self.model.checkpoint}"
        elif self.model.preset is not None:
            mcfg = dataclasses.replace(ModelConfig.preset(self.model.preset), **dict(self.model.overrides))
            where = f"model.preset={self.model.preset}"
        else:  # a checkpoint that does not exist yet: prepare_base reports it
            return
        if mode == "dcp":
            require(
                "minimax_m3_sparse" in mcfg.layer_types,
                f"rollout.engine_parallel=dcp: {where} has no sparse attention layer (MSA), whose KV and "
                "index-key pages DCP spreads over the ranks; use rollout.engine_parallel=none",
            )
            require(
                mcfg.vision_config is None,
                f"rollout.engine_parallel=dcp: {where} has a vision tower; image prompts through a DCP "
                "replica are not supported yet: use rollout.engine_parallel=none",
            )
            return
        require(
            "sparse" in mcfg.mlp_layer_types,
            f"rollout.engine_parallel=dep: {where} has no MoE layer (routed experts) to shard; use "
            "rollout.engine_parallel=none",
        )
        require(
            mcfg.num_local_experts % ranks == 0,
            f"rollout.engine_parallel=dep: {where} has {mcfg.num_local_experts} routed experts, not "
            f"divisible by rollout.engine_ranks={ranks}; pick engine_ranks dividing {mcfg.num_local_experts}",
        )


# ----------------------------------------------------------------------------- loading and saving
def available_recipes(recipes_dir: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (recipes_dir or RECIPES_DIR).glob("*.yaml"))


def load_config(
    recipe: str, overrides: Sequence[str] = (), *, recipes_dir: Path | str | None = None
) -> TrainConfig:
    """`recipe` is a name in `recipes_dir` (default: the repo's recipes/) or a path to a .yaml file;
    `overrides` are `dotted.key=value` strings applied in order after the recipe."""
    rdir = Path(recipes_dir) if recipes_dir is not None else RECIPES_DIR
    if recipe.endswith((".yaml", ".yml")) and Path(recipe).is_file():
        name, body = Path(recipe).stem, _compose_file(Path(recipe), rdir, ())
    else:
        name, body = recipe, _compose(recipe, rdir, ())
    cfg = _merge(OmegaConf.structured(TrainConfig), body, f"recipe {name!r}")
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        where = f"override {_clip(item)!r}"
        require(bool(sep) and bool(key), f"{where} is not key=value (e.g. trainer.total_steps=5)")
        key = _renamed(key, value.strip().lower() in ("true", "false"), where)
        if key == "recipe":
            raise ValueError("'recipe' cannot be overridden; pass it as recipe=NAME to the entry point")
        _check_key_path(key.split("."), where)
        try:  # the value is parsed as YAML: bad syntax, NUL bytes, absurd nesting or digit counts
            dotlist = OmegaConf.from_dotlist([f"{key}={value}"])
        except (yaml.YAMLError, ValueError, RecursionError, OmegaConfBaseException) as e:
            detail = " ".join(str(e).split())[:300]
            raise ValueError(
                f"{where}: cannot parse the value of {key!r} ({type(e).__name__}: {detail})"
            ) from None
        cfg = _merge(cfg, dotlist, where, key)
    cfg.recipe = name
    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return _to_object(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    path.write_text(f"# resolved config of recipe {cfg.recipe!r} (rl.config.config_from_yaml)\n{text}")


def config_from_yaml(path: str | Path) -> TrainConfig:
    """Read a config written by `save_config` (or any full/partial config YAML) back, validated."""
    body = _rename_tree(_load_yaml(Path(path)), f"config {str(path)!r}")
    return _to_object(_merge(OmegaConf.structured(TrainConfig), body, f"config {str(path)!r}"))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict (lists for tuples) for W&B's run config and JSON."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(out, dict)
    return _lists(out)


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


# -------------------------------------------------------------------------------------- internals
def _load_yaml(path: Path) -> dict[str, Any]:
    body = yaml.safe_load(path.read_text()) or {}
    require(isinstance(body, dict), f"{path}: a recipe must be a YAML mapping, got {type(body).__name__}")
    return body


def _compose(name: str, rdir: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    valid = available_recipes(rdir)
    if name not in valid:
        via = f" (in the defaults of {chain[-1]!r})" if chain else ""
        raise ValueError(f"unknown recipe {name!r}{via}; valid recipes: {valid}")
    return _compose_file(rdir / f"{name}.yaml", rdir, chain)


def _compose_file(path: Path, rdir: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    """The recipe's `defaults` (merged in order, each recursively composed) then its own body."""
    if path.stem in chain:
        raise ValueError(f"recipe defaults form a cycle: {' -> '.join([*chain, path.stem])}")
    body = _load_yaml(path)
    bases = body.pop("defaults", []) or []
    if isinstance(bases, str):
        bases = [bases]
    require(
        isinstance(bases, list) and all(isinstance(b, str) for b in bases),
        f"{path}: 'defaults' must be a list of recipe names, got {bases!r}",
    )
    _rename_tree(body, f"recipe {path.stem!r}")
    _check_tree(body, TrainConfig, "", f"recipe {path.stem!r}")
    merged = OmegaConf.create({})
    for base in bases:
        merged = OmegaConf.merge(merged, _compose(base, rdir, (*chain, path.stem)))
    out = OmegaConf.to_container(OmegaConf.merge(merged, body))
    assert isinstance(out, dict)
    return out


def _renamed(key: str, is_bool: bool, where: str) -> str:
    """The current spelling of dotted `key` (RENAMED_KEYS), warning when it was an old one."""
    new = RENAMED_KEYS.get(key)
    if new is None or (key == "rollout.dspark.cotrain" and not is_bool):
        return key
    warnings.warn(f"{where}: {key} is deprecated: write {new}", FutureWarning, stacklevel=3)
    return new


def _rename_tree(body: dict[str, Any], where: str) -> dict[str, Any]:
    """Move the old keys of a recipe / config body (RENAMED_KEYS) to their new place, in place.
    Table order matters: the old bool switch moves before its siblings fill the new section."""
    for old, new in RENAMED_KEYS.items():
        *path, leaf = old.split(".")
        node: Any = body
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node[leaf]
        if _renamed(old, isinstance(value, bool), where) == old:
            continue
        del node[leaf]
        *new_path, new_leaf = new.split(".")
        node = body
        for part in new_path:
            node = node.setdefault(part, {})
        node[new_leaf] = value
    return body


def _section_of(cls: type, name: str) -> type | None:
    """The dataclass type of field `name` of `cls`, or None for a leaf (or open dict)."""
    hint = typing.get_type_hints(cls)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def _unknown_key(key: str, section: str, cls: type, where: str) -> ValueError:
    valid = [f.name for f in dataclasses.fields(cls)]
    scope = f"section {_clip(section)!r}" if section else "the top level"
    return ValueError(f"{where}: unknown key {_clip(key)!r} in {scope}; valid keys: {valid}")


def _clip(text: str, limit: int = 200) -> str:
    """User input echoed in an error, shortened: a megabyte override must not become the message."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def _check_key_path(parts: list[str], where: str) -> None:
    cls: type | None = TrainConfig
    for i, part in enumerate(parts):
        if cls is None:  # below a leaf or an open dict (model.overrides: checked in __post_init__)
            return
        if part not in {f.name for f in dataclasses.fields(cls)}:
            raise _unknown_key(part, ".".join(parts[:i]), cls, where)
        cls = _section_of(cls, part)
    if cls is not None:
        valid = [f.name for f in dataclasses.fields(cls)]
        raise ValueError(
            f"{where}: {'.'.join(parts)!r} is a section, not a value; set one of its keys "
            f"(e.g. {'.'.join(parts)}.{valid[0]}=...); valid keys: {valid}"
        )


def _check_tree(node: dict[str, Any], cls: type, prefix: str, where: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in node.items():
        if key not in names:
            raise _unknown_key(key, prefix.rstrip("."), cls, where)
        sub = _section_of(cls, key)
        if sub is not None and isinstance(value, dict):
            _check_tree(value, sub, f"{prefix}{key}.", where)


def _type_name(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if get_origin(hint) is not None:
        return repr(hint).replace("typing.", "")
    return getattr(hint, "__name__", repr(hint))


def _expected(full_key: str) -> str:
    cls: Any = TrainConfig
    hint: Any = None
    for part in full_key.split("."):
        if not dataclasses.is_dataclass(cls):
            return "a value of the declared type"
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return "a value of the declared type"
        hint = hints[part]
        cls = hint
    if dataclasses.is_dataclass(hint):
        return f"a mapping (section {full_key!r}), not a single value"
    return _type_name(hint)


def _merge(cfg: DictConfig, other: Any, where: str, key: str | None = None) -> DictConfig:
    try:
        merged = OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or key
        detail = str(e).split("\n")[0]
        if not key:
            raise ValueError(f"{where}: {detail}") from None
        raise ValueError(
            f"{where}: invalid value for {key!r}: expected {_expected(key)} ({detail})"
        ) from None
    assert isinstance(merged, DictConfig)
    return merged


def _to_object(cfg: DictConfig) -> TrainConfig:
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an unresolvable ${...} interpolation: name the key
        key = getattr(e, "full_key", None)
        detail = str(e).split("\n")[0]
        raise ValueError(f"invalid value for {key!r}: {detail}" if key else detail) from None
    assert isinstance(obj, TrainConfig)
    return obj
