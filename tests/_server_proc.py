"""Waiting for a server started as a subprocess by a test."""

from __future__ import annotations

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
