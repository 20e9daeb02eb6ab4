"""Entry point: `python -m rl.train recipe=NAME [dotted.key=value ...]`.

The GRPO trainer (issue "GRPO trainer on Ray, end to end") is not built yet. Until it is, this
entry point validates the command line and the recipe name, then says plainly what is missing and
exits non-zero, so `make quickstart` never pretends to train.
"""

from __future__ import annotations

import sys
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    """Split `recipe=NAME` from the dotted overrides; errors name the fix."""
    recipe, overrides = None, []
    for arg in argv:
        if "=" not in arg:
            raise SystemExit(f"error: argument {arg!r} is not key=value; usage: python -m rl.train recipe=NAME")
        key, value = arg.split("=", 1)
        if key == "recipe":
            recipe = value
        else:
            overrides.append(arg)
    if recipe is None:
        raise SystemExit(f"error: no recipe given; usage: python -m rl.train recipe=NAME (one of {available_recipes()})")
    return recipe, overrides


def main(argv: list[str] | None = None) -> int:
    recipe, _ = parse_args(sys.argv[1:] if argv is None else argv)
    if recipe not in available_recipes():
        print(f"error: unknown recipe {recipe!r}; valid recipes: {available_recipes()}", file=sys.stderr)
        return 2
    print(
        f"recipe {recipe!r} found, but the GRPO trainer is not implemented yet "
        "(missing: model/modeling.py, rollout/native engine, rl/trainer.py). Nothing was run.",
        file=sys.stderr,
    )
    return 3


if __name__ == "__main__":
    sys.exit(main())
