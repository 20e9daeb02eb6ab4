"""rl/config.py: recipes, composition, typed overrides, clear errors, save/load round trip."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rl.config import (
    TrainConfig,
    available_recipes,
    config_from_yaml,
    config_to_dict,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[2]


def _write(d: Path, name: str, text: str) -> None:
    (d / f"{name}.yaml").write_text(text)


def test_shipped_recipes_load_and_validate():
    assert {"quickstart", "dapo_math"} <= set(available_recipes())
    q = load_config("quickstart")
    assert (q.recipe, q.model.preset, q.data.kind, q.model.tokenizer) == (
        "quickstart",
        "tiny",
        "arithmetic",
        "byte",
    )
    assert (q.rollout.backend, q.trainer.device, q.lora.r) == ("native", "cpu", 32)
    assert q.model.checkpoint == "runs/_cache/quickstart-base"
    d = load_config("dapo_math")
    assert (d.model.preset, d.data.kind, d.trainer.total_steps, d.trainer.eval_n_samples) == (
        "m3.1-flash",
        "dapo_math",
        200,
        32,
    )
    assert (d.rollout.max_tokens, d.reward.overlong_buffer, d.algo.eps_low, d.algo.eps_high) == (
        20480,
        4096,
        0.2,
        0.28,
    )
    assert {"q_proj", "o_proj", "gate_proj", "down_proj"} <= set(d.lora.target_modules)
    gpus = d.rollout.num_workers * d.rollout.num_gpus + d.trainer.num_learners * d.trainer.num_gpus
    assert gpus == 16


def test_dapo_math_documented_cpu_dry_run_overrides_give_a_cpu_tiny_config():
    text = (REPO / "recipes" / "dapo_math.yaml").read_text()
    block = text.split("CPU dry run")[1].split("\n#\n")[0]
    command = " ".join(line.lstrip("#").strip().rstrip("\\") for line in block.splitlines()[1:])
    args = shlex.split(command)
    assert args[:4] == ["python", "-m", "rl.train", "recipe=dapo_math"]
    cfg = load_config("dapo_math", args[4:])
    assert (cfg.model.preset, cfg.model.checkpoint, cfg.trainer.total_steps) == ("tiny", None, 2)
    assert (cfg.trainer.device, cfg.rollout.backend, cfg.rollout.num_gpus, cfg.trainer.num_gpus) == (
        "cpu", "native", 0.0, 0.0,
    )  # fmt: skip
    assert cfg.data.train_path == "../shared/data/dapo_math_17k.parquet"
    assert (cfg.trainer.num_learners, cfg.trainer.learner_parallel) == (1, "none")
    flagship = load_config("dapo_math").trainer
    assert (flagship.num_learners, flagship.learner_parallel, flagship.num_gpus) == (4, "dep", 1.0)


def test_overrides_are_typed_nested_and_list_valued():
    cfg = load_config(
        "quickstart",
        [
            "trainer.total_steps=5",
            "model.overrides.hidden_size=64",
            "lora.target_modules=[q_proj,v_proj]",
            "algo.tis_cap=null",
            "optim.lr=3e-4",
            "optim.betas=[0.8,0.95]",
            "rollout.kv_cache_dtype=nvfp4",
            "trainer.kv_sim=true",
        ],
    )
    assert cfg.trainer.total_steps == 5 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.model.overrides == {"hidden_size": 64}
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.algo.tis_cap is None
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.95)
    assert cfg.rollout.kv_cache_dtype == "nvfp4" and cfg.trainer.kv_sim is True
    assert isinstance(cfg, TrainConfig)


def test_output_dir_defaults_to_recipe_and_timestamp_unless_overridden():
    cfg = load_config("quickstart")
    assert re.fullmatch(r"runs/quickstart-\d{8}-\d{6}", cfg.output_dir)
    assert load_config("quickstart", ["output_dir=/tmp/x"]).output_dir == "/tmp/x"


def test_unknown_recipe_error_lists_valid_recipes():
    with pytest.raises(
        ValueError, match=r"unknown recipe 'nope'.*valid recipes: \[.*'dapo_math'.*'quickstart'"
    ):
        load_config("nope")


def test_unknown_key_error_names_key_and_lists_section_keys():
    with pytest.raises(
        ValueError, match=r"unknown key 'total_stepz' in section 'trainer'; valid keys: \[.*'total_steps'"
    ):
        load_config("quickstart", ["trainer.total_stepz=3"])
    with pytest.raises(ValueError, match=r"unknown key 'foo' in the top level; valid keys: \[.*'trainer'"):
        load_config("quickstart", ["foo.bar=1"])
    with pytest.raises(
        ValueError, match=r"unknown ModelConfig field\(s\) \['hiden_size'\]; valid fields: \[.*'hidden_size'"
    ):
        load_config("quickstart", ["model.overrides.hiden_size=64"])
    with pytest.raises(ValueError, match=r"'model' is a section.*'preset'"):
        load_config("quickstart", ["model=tiny"])


def test_wrong_type_error_names_key_and_expected_type():
    with pytest.raises(ValueError, match=r"'trainer.total_steps': expected int"):
        load_config("quickstart", ["trainer.total_steps=abc"])
    with pytest.raises(
        ValueError,
        match=r"'rollout.kv_cache_dtype': expected one of 'fp32', 'bf16', 'fp8', 'nvfp4', "
        r"'nvfp4_4over6' or null",
    ):
        load_config("quickstart", ["rollout.kv_cache_dtype=fp4"])
    with pytest.raises(ValueError, match=r"'trainer.kv_sim': expected bool"):
        load_config("quickstart", ["trainer.kv_sim=maybe"])
    with pytest.raises(ValueError, match=r"'optim.betas': expected tuple\[float, float\]"):
        load_config("quickstart", ["optim.betas=[0.9,0.99,0.999]"])


def test_invalid_values_fail_validation_with_the_field_name():
    with pytest.raises(ValueError, match=r"trainer.total_steps must be >= 1, got 0"):
        load_config("quickstart", ["trainer.total_steps=0"])
    with pytest.raises(ValueError, match=r"lora.target_modules: unknown module\(s\) \['w1'\]"):
        load_config("quickstart", ["lora.target_modules=[q_proj,w1]"])
    with pytest.raises(
        ValueError, match=r"reward.overlong_buffer \(12\) must be < rollout.max_tokens \(12\)"
    ):
        load_config("quickstart", ["reward.overlong_buffer=12"])
    with pytest.raises(ValueError, match=r"algo.mini_batch_prompts must divide algo.batch_prompts=32, got 5"):
        load_config("quickstart", ["algo.mini_batch_prompts=5"])
    with pytest.raises(ValueError, match=r"model.preset: unknown preset 'huge'"):
        load_config("quickstart", ["model.preset=huge"])
    with pytest.raises(ValueError, match=r"rollout.async_decode=true .* set rollout.async_decode=null"):
        load_config("quickstart", ["rollout.async_decode=true", "rollout.backend=vllm"])
    assert load_config("quickstart", ["rollout.async_decode=false"]).rollout.async_decode is False


def test_defaults_compose_in_order_then_own_body_wins(tmp_path):
    _write(tmp_path, "base", "trainer:\n  total_steps: 7\n  eval_every: 3\nlora:\n  r: 8\n")
    _write(tmp_path, "mid", "defaults: [base]\ntrainer:\n  eval_every: 4\nrollout:\n  n_samples: 2\n")
    _write(tmp_path, "top", "defaults: [mid]\nrollout:\n  n_samples: 3\n")
    cfg = load_config("top", ["lora.r=16"], recipes_dir=tmp_path)
    assert (cfg.recipe, cfg.trainer.total_steps, cfg.trainer.eval_every) == ("top", 7, 4)
    assert (cfg.rollout.n_samples, cfg.lora.r) == (3, 16)


def test_defaults_errors_unknown_base_cycle_and_bad_key_in_recipe(tmp_path):
    _write(tmp_path, "a", "defaults: [missing]\n")
    with pytest.raises(
        ValueError, match=r"unknown recipe 'missing' \(in the defaults of 'a'\); valid recipes"
    ):
        load_config("a", recipes_dir=tmp_path)
    _write(tmp_path, "b", "defaults: [c]\n")
    _write(tmp_path, "c", "defaults: [b]\n")
    with pytest.raises(ValueError, match=r"cycle: b -> c -> b"):
        load_config("b", recipes_dir=tmp_path)
    _write(tmp_path, "d", "trainer:\n  totl_steps: 3\n")
    with pytest.raises(ValueError, match=r"recipe 'd': unknown key 'totl_steps' in section 'trainer'"):
        load_config("d", recipes_dir=tmp_path)
    _write(tmp_path, "e", "trainer:\n  total_steps: many\n")
    with pytest.raises(
        ValueError, match=r"recipe 'e': invalid value for 'trainer.total_steps': expected int"
    ):
        load_config("e", recipes_dir=tmp_path)


def test_recipe_may_be_a_yaml_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("defaults: [quickstart]\ntrainer:\n  total_steps: 3\n")
    cfg = load_config(str(path))
    assert (cfg.recipe, cfg.trainer.total_steps, cfg.data.kind) == ("mine", 3, "arithmetic")


def test_save_then_load_config_round_trips_equal(tmp_path):
    cfg = load_config("dapo_math", ["model.overrides.num_hidden_layers=2", "algo.tis_cap=null"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    back = config_from_yaml(tmp_path / "run" / "config.yaml")
    assert back == cfg
    assert config_to_dict(back)["optim"]["betas"] == [0.9, 0.999]


def test_tracking_mode_none_resolves_from_wandb_mode_then_api_key(monkeypatch):
    cfg = load_config("quickstart")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert cfg.tracking.resolved_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert cfg.tracking.resolved_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert cfg.tracking.resolved_mode() == "online"
    assert load_config("quickstart", ["tracking.mode=disabled"]).tracking.resolved_mode() == "disabled"


def test_projector_modules_are_checked_and_need_the_native_engine():
    cfg = load_config("geo_vision", ["lora.projector_modules=[multi_modal_projector]"])
    assert cfg.lora.projector_modules == ["multi_modal_projector"]
    with pytest.raises(ValueError, match=r"lora.projector_modules: unknown module\(s\) \['vision_tower'\]"):
        load_config("geo_vision", ["lora.projector_modules=[vision_tower]"])
    with pytest.raises(ValueError, match=r"set rollout\.backend=native"):
        load_config("geo_vision", ["lora.projector_modules=[patch_merge_mlp]", "rollout.backend=vllm"])


def test_lora_section_is_the_model_lora_config_itself():
    # The section is model.layers.lora_config.LoRAConfig (no mirror to keep in step): build, sync and
    # export read cfg.lora as it is, and its checks and messages are the recipe's.
    from model.layers.lora import LoRAConfig

    cfg = load_config(
        "geo_vision",
        ["lora.routed_experts=true", "lora.dtype=bfloat16", "lora.projector_modules=[patch_merge_mlp]"],
    )
    assert type(cfg.lora) is LoRAConfig
    assert (cfg.lora.routed_experts, cfg.lora.dtype, cfg.lora.projector_modules) == (
        True,
        "bfloat16",
        ["patch_merge_mlp"],
    )
    assert cfg.lora.scaling == cfg.lora.alpha / cfg.lora.r
    with pytest.raises(ValueError, match=r"lora.r must be a positive int, got 0"):
        load_config("quickstart", ["lora.r=0"])
    with pytest.raises(ValueError, match=r"unknown key 'rank' in section 'lora'; valid keys: \[.*'r'"):
        load_config("quickstart", ["lora.rank=8"])


def test_loading_a_config_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rl.config import load_config\ncfg = load_config('dapo_math')\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_learner_parallel_off_is_none_and_the_old_dp_warns_with_the_new_spelling():
    assert load_config("quickstart").trainer.learner_parallel == "none"
    with pytest.warns(FutureWarning, match=r"write trainer\.learner_parallel=none"):
        cfg = load_config("quickstart", ["trainer.learner_parallel=dp"])
    assert cfg.trainer.learner_parallel == "none"
    with pytest.raises(ValueError, match=r"use trainer\.learner_parallel=none"):
        load_config("quickstart_vllm", ["trainer.learner_parallel=dep"])


def test_every_hint_in_rl_names_a_value_its_key_accepts():
    # A message that says `section.key=value` for a key with fixed choices must name one of them
    # (trainer.learner_parallel=none was once advised while the config accepted only dp|dep).
    import typing

    hinted = set()
    for path in (REPO / "rl").glob("*.py"):
        hinted |= set(re.findall(r"\b((?:[a-z]+\.)+[a-z_]+)=([a-z0-9_.|-]+)", path.read_text()))
    checked = 0
    for key, values in sorted(hinted):
        hint: typing.Any = TrainConfig
        for part in key.split("."):
            hints = typing.get_type_hints(hint) if hasattr(hint, "__dataclass_fields__") else {}
            hint = hints.get(part)
        choices = {a for t in (typing.get_args(hint) or (hint,)) for a in typing.get_args(t)}
        if typing.get_origin(hint) is typing.Literal:
            choices = set(typing.get_args(hint))
        if not choices:
            continue
        for value in values.rstrip("|").split("|"):
            assert value in choices or (value == "null" and type(None) in typing.get_args(hint)), (key, value)
            checked += 1
    assert checked >= 10


def test_dspark_cotrain_section_is_the_cotrainer_config_and_old_keys_still_work(tmp_path):
    from rollout.dspark.cotrain_config import CoTrainConfig

    new = [
        "rollout.dspark.drafter=/d",
        "rollout.dspark.cotrain.enabled=true",
        "rollout.dspark.cotrain.steps=3",
    ]
    cfg = load_config("quickstart", new)
    assert cfg.rollout.dspark.cotrain == CoTrainConfig(enabled=True, steps=3)
    old = ["rollout.dspark.drafter=/d", "rollout.dspark.cotrain=true", "rollout.dspark.cotrain_steps=3"]
    with pytest.warns(
        FutureWarning,
        match=r"rollout\.dspark\.cotrain_steps is deprecated: write rollout\.dspark\.cotrain\.steps",
    ):
        assert load_config("quickstart", old).rollout.dspark == cfg.rollout.dspark
    _write(
        tmp_path,
        "old",
        "defaults: [quickstart]\nrollout:\n  dspark:\n    drafter: /d\n    cotrain_steps: 3\n"
        "    cotrain: true\n",
    )
    with pytest.warns(FutureWarning, match=r"rollout\.dspark\.cotrain is deprecated"):
        assert load_config(str(tmp_path / "old.yaml")).rollout.dspark.cotrain == cfg.rollout.dspark.cotrain
    with pytest.raises(ValueError, match=r"needs rollout\.dspark\.drafter=DIR"):
        load_config("quickstart", ["rollout.dspark.cotrain.enabled=true"])
    with pytest.raises(ValueError, match=r"unknown key 'stepz' in section 'rollout\.dspark\.cotrain'"):
        load_config("quickstart", ["rollout.dspark.cotrain.stepz=3"])
