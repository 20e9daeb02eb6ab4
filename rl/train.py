"""Entry point: `python -m rl.train recipe=NAME [dotted.key=value ...]`.

Parses the command line, loads and validates the recipe (rl/config.py), builds the quickstart's
warmed-up base if the recipe asks for it, and runs the GRPO trainer (rl/trainer.py). Bad input (an
unknown recipe or key, a wrong type, a missing checkpoint) ends with a one-line error naming the
problem and the fix, and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = "usage: python -m rl.train recipe=NAME [dotted.key=value ...]"


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    """Split `recipe=NAME` from the dotted overrides; errors name the fix."""
    recipe, overrides = None, []
    for arg in argv:
        if arg in ("-h", "--help"):
            raise SystemExit(
                f"{USAGE}\n\nrecipes live in recipes/*.yaml; every key is documented in rl/config_sections.py"
            )
        if "=" not in arg:
            raise ValueError(f"argument {arg!r} is not key=value; {USAGE}")
        key, value = arg.split("=", 1)
        if key == "recipe":
            recipe = value
        else:
            overrides.append(arg)
    if recipe is None:
        from rl.config import available_recipes

        raise ValueError(f"no recipe given; {USAGE} (recipes: {available_recipes()})")
    return recipe, overrides


# Exceptions that mean "the recipe / overrides / command line are wrong" while the config is built:
# reported as one line, never a traceback. (Errors during the run itself keep their traceback unless
# they are ValueError / FileNotFoundError, which this project raises with a message naming the fix.)
_MAX_ERROR_CHARS = 2000


def _one_line(e: BaseException) -> str:
    """The message on one line, cut so that a huge bad input is not echoed back whole."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + " ... (cut)"


def _config_errors() -> tuple[type[BaseException], ...]:
    import yaml

    # RecursionError: absurdly nested YAML or override values; UnicodeError (a ValueError) and
    # OSError: recipe paths that are directories, unreadable, or not text.
    return (ValueError, TypeError, KeyError, OSError, RecursionError, yaml.YAMLError)


def main(argv: list[str] | None = None) -> int:
    from rl.config import load_config

    try:
        recipe, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(recipe, overrides)
    except _config_errors() as e:
        if isinstance(e, RecursionError):
            msg = "the recipe or an override is nested too deeply to parse"
        else:
            prefix = "invalid YAML in the recipe: " if type(e).__module__.startswith("yaml") else ""
            msg = prefix + _one_line(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    try:
        if cfg.model.warmup and cfg.model.checkpoint and cfg.model.family == "hf":
            from rollout.bases.hf_toy import ensure_hf_toy_base

            ensure_hf_toy_base(Path(cfg.model.checkpoint))
        elif cfg.model.warmup and cfg.model.checkpoint:
            from rollout.bases.warmup import ensure_base

            ensure_base(Path(cfg.model.checkpoint), preset=cfg.model.preset, device=cfg.trainer.device)
        from rl.trainer import run

        final = run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    summary = ", ".join(
        f"{k} {v:.3f}" for k, v in final.items() if k in ("eval/acc", "reward/mean", "acc/mean")
    )
    print(f"done: {cfg.output_dir} ({summary}); adapter in {Path(cfg.output_dir) / 'adapter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
