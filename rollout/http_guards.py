"""Guards against slow or unauthorised HTTP clients, as ASGI middleware and a uvicorn protocol.

Why: uvicorn waits forever for request headers and bodies, and the server must be able to require
an API key. `RequireAPIKey` checks `Authorization: Bearer KEY` in constant time on every route but
/health; `BodyTimeout` answers 408 to a body not received within its deadline;
`HeaderTimeoutH11Protocol` closes a connection whose headers do not complete in time;
`uvicorn_config` builds uvicorn settings that use it.
"""

from __future__ import annotations

import asyncio
import hmac

from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout.openai_api import error_json


class RequireAPIKey:
    """`Authorization: Bearer KEY` on every route but /health, compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.key):
                msg = "missing or wrong API key: send the header 'Authorization: Bearer KEY'"
                return await error_json(401, msg, "authentication_error")(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTimeout:
    """A request body not fully received within `seconds` of the request's start gets a 408 (and
    the connection is closed): a half-sent body cannot hold a connection."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.seconds
        state = {"body_done": False, "timed_out": False}

        async def timed_receive():
            if state["body_done"] or state["timed_out"]:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except TimeoutError:
                state["timed_out"] = True
                return {"type": "http.disconnect"}
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                state["body_done"] = True
            return msg

        async def guarded_send(msg):
            if not state["timed_out"]:
                return await send(msg)
            if msg["type"] == "http.response.start":
                text = f"the request body was not received within {self.seconds:g} s"
                resp = error_json(408, text, "invalid_request_error")
                await send(
                    {
                        "type": "http.response.start",
                        "status": 408,
                        "headers": [*resp.raw_headers, (b"connection", b"close")],
                    }
                )
                await send({"type": "http.response.body", "body": resp.body})

        await self.app(scope, timed_receive, guarded_send)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    `header_timeout_s` of their first byte (uvicorn itself waits forever)."""

    header_timeout_s = 10.0

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and getattr(self, "_header_timer", None) is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_header_timer()

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def uvicorn_config(app, host: str, port: int, header_timeout_s: float = 10.0, **kw):
    """uvicorn settings with the header timeout (HeaderTimeoutH11Protocol)."""
    import uvicorn

    protocol = type("Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, **kw)
