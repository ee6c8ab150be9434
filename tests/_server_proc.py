"""Test helpers for servers: waiting for one started as a subprocess, and a client that can vanish mid-request."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import httpx


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float, poll: float = 0.1) -> None:
    """Return once ``url``/health answers; fail the test if ``proc`` exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(poll)


def raw_completion(url: str, body: dict) -> socket.socket:
    """Send a non-streaming ``/v1/completions`` request over a bare socket and return it unread, so a test can
    close it (a client that goes away) while the server works on the request."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return sock
