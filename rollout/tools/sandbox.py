"""The `python` tool: model-written code run in a separate, limited process per call.

Layers, honestly: (1) a fresh process (`python -I -S`) in a new session, killed with its whole
process group at the wall-time limit; (2) setrlimit in preexec_fn: CPU seconds, address space,
file size, open files, processes; (3) when run as root, the child drops to uid/gid 65534 so the
file system's permissions (not a guard) stop writes outside its scratch directory (its cwd, the
only place it owns; world-writable dirs like /tmp stay writable: a known gap); (4) no network: a
new network namespace via `unshare -rn` when it works here, and always a Python-level guard that
makes socket creation fail (bypassable by native code, hence layer 4a). Never raises into the caller.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from rollout.tools.registry import tool

_NOBODY = 65534
_GUARD = """import socket as _s
def _no_net(*a, **k):
    raise PermissionError("network access is disabled in this sandbox")
_s.socket = _no_net; _s.create_connection = _no_net; _s.socketpair = _no_net
del _s, _no_net
"""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_bytes: int = 512 << 20  # address space: a 1 GB allocation is refused
    file_bytes: int = 1 << 20
    processes: int = 16
    open_files: int = 64
    output_bytes: int = 8192


def _unshare_works() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_USE_UNSHARE = _unshare_works()
# A system interpreter that uid 65534 can execute (a venv or pyenv under /root may be unreadable to
# it); `-I -S` needs no site-packages, so any CPython 3 will do.
_INTERPRETER = shutil.which("python3", path="/usr/bin:/bin") or os.path.realpath(sys.executable)


def _preexec(limits: Limits, drop_to: int | None):
    def apply():
        for res, value in (
            (resource.RLIMIT_CPU, limits.cpu_s),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(res, (value, value))
        if drop_to is not None:
            os.setgroups([])
            os.setgid(drop_to)
            os.setuid(drop_to)
        # After the uid drop: RLIMIT_NPROC counts the processes of the (now unprivileged) user.
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    return apply


# The CPU-time limit (soft = hard) ends a process by SIGKILL (SIGXCPU where the soft limit is lower);
# nothing else in the sandbox sends SIGKILL to the child except the wall-time kill. Which of the two
# limits fires first depends on the machine's load, so both give the same message: a trajectory (and a
# resumed run) must not depend on timing.
_TIMEOUT_SIGNALS = (signal.SIGXCPU, signal.SIGKILL)
_TIMEOUT_NOTE = "error: time limit exceeded"


def is_timeout(result: str) -> bool:
    """Whether a `run_python` result reports its wall-time or CPU-time limit (a sandbox timeout)."""
    return _TIMEOUT_NOTE in result


def run_python(code: str, limits: Limits = Limits()) -> str:
    """stdout+stderr of `code` (truncated), or an error message; never raises."""
    drop_to = _NOBODY if os.geteuid() == 0 else None
    try:
        with tempfile.TemporaryDirectory(prefix="sandbox-") as scratch:
            if drop_to is not None:
                os.chown(scratch, drop_to, drop_to)
            # The program comes in on stdin (`python -`), so tracebacks name "<stdin>", never the random
            # scratch path: the same code gives the same reply on every run (resumed runs replay).
            program = (_GUARD + code).encode("utf-8", errors="replace")
            cmd = [_INTERPRETER, "-I", "-S", "-"]
            if _USE_UNSHARE:
                cmd = [shutil.which("unshare"), "-rn", *cmd]
            proc = subprocess.Popen(
                cmd,
                cwd=scratch,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch},
                start_new_session=True,
                preexec_fn=_preexec(limits, drop_to),
            )
            timeout_note = (f"\n{_TIMEOUT_NOTE} (CPU {limits.cpu_s} s, wall {limits.wall_s} s); "
                            "the process was killed")  # fmt: skip
            try:
                out, _ = proc.communicate(program, timeout=limits.wall_s)
                note = ""
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                note = timeout_note
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group (forked children)
                os.killpg(proc.pid, signal.SIGKILL)
            text = out[: limits.output_bytes].decode("utf-8", errors="replace")
            if len(out) > limits.output_bytes:
                text += f"\n[output truncated to {limits.output_bytes} bytes]"
            if proc.returncode and not note and -proc.returncode in _TIMEOUT_SIGNALS:
                note = timeout_note
            if proc.returncode and not note:
                sig = -proc.returncode if proc.returncode < 0 else None
                why = (
                    f"killed by signal {signal.Signals(sig).name}"
                    if sig
                    else f"exit status {proc.returncode}"
                )
                note = f"\nerror: the program ended with {why}"
            return text + note
    except Exception as e:  # the sandbox's own failure is still just a message to the model
        return f"error: sandbox failed: {type(e).__name__}: {e}"


@tool(
    "python",
    "Run Python code in a sandbox (no network, small CPU/memory limits); returns its printed output.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
)
def python(code: str) -> str:
    return run_python(code)
