"""A real uvicorn server on 127.0.0.1 (a free port, in a thread) for tests that speak HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from rollout.http_guards import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(app, header_timeout_s: float = 10.0):
    """Serves `app` (rollout.server.build_app) until the block ends; yields the base URL. The
    app's engine worker is closed afterwards."""
    port = free_port()
    config = uvicorn_config(app, "127.0.0.1", port, header_timeout_s=header_timeout_s, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the server did not start within 20 s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.worker.close()
