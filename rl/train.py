"""Entry point: `python -m rl.train recipe=NAME [dotted.key=value ...]`.

Parses the command line, loads and validates the recipe (rl/config.py), builds the quickstart's
warmed-up base if the recipe asks for it, and runs the GRPO trainer (rl/trainer.py). Bad input (an
unknown recipe or key, a wrong type, a missing checkpoint) ends with a one-line error naming the
problem and the fix, and exit code 2; so does a bad `output_dir` (checked before anything is
written) and a project error raised inside a Ray actor (a corrupt checkpoint, a bad data file),
found under Ray's wrappers (`root_error`).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
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


def check_output_dir(output_dir: str) -> None:
    """Raise OSError with one line naming the path and the fix unless `output_dir` is (or can be
    made) a writable directory. Creates it (the run would); writes nothing else for long."""
    path = Path(output_dir)
    fix = "Fix: set output_dir=DIR to a directory you can write (a new path is created)"
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output_dir {output_dir!r} is a file, not a directory. {fix}")
    above = next((p for p in path.absolute().parents if p.exists()), None)
    if not path.exists() and above is not None and not above.is_dir():
        raise NotADirectoryError(f"output_dir {output_dir!r} lies under {str(above)!r}, a file. {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"output_dir {output_dir!r} is not writable ({e.strerror or type(e).__name__}). {fix}"
        ) from None


# The last "SomeError: message" line of a traceback Ray kept only as text (ActorDiedError).
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")


def root_error(e: BaseException) -> str | None:
    """The one-line message of the project error behind `e`, or None (a bug: keep its traceback).
    Project errors are ValueError (both CheckpointErrors, data and config errors) and OSError
    (files); Ray hides them: RayTaskError keeps the original in `.cause`, ActorDiedError (an
    actor's __init__ raised) only the remote traceback's text, whose last error line is read."""
    from ray.exceptions import RayActorError, RayTaskError

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RayTaskError):  # also an instance of the cause's class: unwrap first
            e = e.cause
            continue
        if isinstance(e, RayActorError):
            lines = [m for ln in str(e).splitlines() if (m := _ERROR_LINE.match(ln.strip()))]
            return f"{lines[-1].group(1)}: {lines[-1].group(2)}" if lines else None
        if isinstance(e, ValueError | OSError):
            return _one_line(e)
        e = e.__cause__ or e.__context__
    return None


def _start_ray(cfg) -> None:
    """Ray for the CLI run, as the trainer would start it but with the actors' output kept in Ray's
    log files: an error inside an actor reaches the driver as an exception (one line through
    `root_error`), not as its traceback streamed to this terminal once per actor."""
    import logging

    # Ray announces at every start that token authentication is on (its default); not ours to say.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    from rl.topology import start_ray

    start_ray(cfg, log_to_driver=False)


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
        check_output_dir(cfg.output_dir)
    except OSError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        if cfg.model.warmup and cfg.model.checkpoint and cfg.model.family == "hf":
            from rollout.bases.hf_toy import ensure_hf_toy_base

            ensure_hf_toy_base(Path(cfg.model.checkpoint))
        elif cfg.model.warmup and cfg.model.checkpoint and cfg.model.warmup_task == "tools":
            from rollout.bases.tools_warmup import ensure_tools_base

            ensure_tools_base(Path(cfg.model.checkpoint), cfg.trainer.device, cfg.trainer.torch_threads)
        elif cfg.model.warmup and cfg.model.checkpoint:
            from rollout.bases.warmup import ensure_base

            ensure_base(Path(cfg.model.checkpoint), preset=cfg.model.preset, device=cfg.trainer.device)
        from rl.trainer import run

        _start_ray(cfg)
        final = run(cfg)
    except Exception as e:
        message = root_error(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    summary = ", ".join(
        f"{k} {v:.3f}" for k, v in final.items() if k in ("eval/acc", "reward/mean", "acc/mean")
    )
    print(f"done: {cfg.output_dir} ({summary}); adapter in {Path(cfg.output_dir) / 'adapter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
