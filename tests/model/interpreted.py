"""Running a test module's named checks under the Triton CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so a kernel test module runs its
checks in a child process (`python -m <module> NAME ...`, which prints one JSON line) instead of
setting the flag in the pytest process, where it would reach every other test module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_named(checks: dict[str, Callable], names: Iterable[str], device: str = "cpu") -> dict[str, list]:
    """{name: [ok, message]} for each check (a failing or raising check reports its message)."""
    out = {}
    for name in names:
        try:
            ok, msg = checks[name](device)
        except Exception as exc:  # reported to the parent test with its message
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        out[name] = [bool(ok), "" if ok else str(msg)[:2000]]
    return out


def run_module_interpreted(module: str, names: Iterable[str], timeout_s: float = 600.0) -> dict[str, list]:
    """`python -m module *names` with TRITON_INTERPRET=1; its last stdout line is the JSON result."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *names], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"interpreted checks failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
