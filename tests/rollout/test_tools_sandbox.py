"""rollout/tools/sandbox.py against real attempts; after each the caller runs on and the next call works."""

import socket
import time

import pytest

from rollout.tools.sandbox import Limits, run_python

FAST = Limits(cpu_s=1, wall_s=3.0)


def _next_call_works():
    assert run_python("print(6*7)", FAST).strip() == "42"


def test_plain_code_runs():
    _next_call_works()


def test_socket_connect_to_a_local_listener_fails():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        out = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", FAST)
    finally:
        server.close()
    assert "error" in out.lower() and "disabled" in out
    _next_call_works()


def test_write_outside_the_scratch_directory_fails(tmp_path):
    target = tmp_path / "owned.txt"
    out = run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", FAST)
    assert not target.exists() and "wrote" not in out
    assert run_python("open('ok.txt','w').write('x'); print(open('ok.txt').read())", FAST).strip() == "x"


@pytest.mark.parametrize(
    "code", ["while True: pass", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"]
)
def test_infinite_loop_and_fork_bomb_are_stopped(code):
    t0 = time.monotonic()
    out = run_python(code, FAST)
    assert time.monotonic() - t0 < FAST.wall_s + 2 and "error" in out
    _next_call_works()


def test_a_1gb_allocation_is_refused():
    out = run_python("x = bytearray(1 << 30)\nprint('allocated')", FAST)
    assert "MemoryError" in out and "allocated" not in out
    _next_call_works()


def test_huge_output_is_truncated():
    out = run_python("print('y' * 10_000_000)", FAST)
    assert len(out) < FAST.output_bytes + 200 and "truncated" in out
    _next_call_works()
