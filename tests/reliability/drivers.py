"""`python -m rl.train` as a separate process tree for the crash-and-resume tests: a fresh session (so
the test can SIGKILL the whole group, as after a real crash), without this test process's W&B service
or Ray, stderr kept for the failure message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rl_train(recipe: str, out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rl.train", f"recipe={recipe}", f"output_dir={out}", *overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_SERVICE", "RAY_"))}
    env.update(WANDB_SILENT="true")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
