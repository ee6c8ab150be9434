"""ASGI middleware: read a request body whole before the app sees it, refusing one that is too large (413) or
arrives too slowly (408), so a bad client costs the server nothing but its own connection."""

from __future__ import annotations

import asyncio
import json
import time

from ssmq.runtime.protocol import error_body


async def reject(send, status: int, message: str, kind: str = "invalid_request_error",
                 headers: list | None = None) -> None:
    """Answer an OpenAI-style error and close the connection."""
    body = json.dumps(error_body(message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await reject(send, 413, f"request body of {int(declared)} bytes exceeds the limit of "
                                            f"{self.max_bytes} bytes")
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await reject(send, 408, f"request body not received within {self.timeout_s:g} s")
            if msg["type"] == "http.disconnect":
                return None
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await reject(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel: the app hears a disconnect

        return await self.app(scope, replay, send)
