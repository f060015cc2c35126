"""A real redis-server on a free loopback port, for the routing-index tests.

Started without persistence, so a restart comes back empty, as a Redis that lost its memory
would; `restart` keeps the port, so clients reconnect to the same URL.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from tests.procs import free_port

REDIS_SERVER = shutil.which("redis-server")
START_TIMEOUT_S = 10.0


class RedisServer:
    def __init__(self) -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def redis_server():
    """A RedisServer running for the module (import this fixture into a test module)."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()
