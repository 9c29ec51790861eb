"""A real redis-server (Debian's) on a free port, for the shared-state tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from gateway_fakes import free_port


def redis_binary() -> str:
    """The redis-server binary, or skip (fail under REQUIRE_REAL_ENGINES: CI installs it)."""
    path = shutil.which("redis-server")
    if path is None:
        msg = "redis-server is not installed (make sysdeps: apt-get install redis-server)"
        if os.environ.get("REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class RedisServer:
    """``start()``/``kill()`` as often as a test likes; always the same port.

    ``tls``: (CA, certificate, key) files: TLS only, client certificates required.
    ``users``: ACL rules (``"tg on >pw ~tailguard:* +@all"``); the default user is off.
    """

    def __init__(self, tls: tuple[str, str, str] | None = None,
                 users: tuple[str, ...] = ()) -> None:
        self.binary = redis_binary()
        self.port = free_port()
        self.tls = tls
        self.users = users
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no"]
        if self.tls is not None:
            ca, cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-ca-cert-file", ca,
                     "--tls-cert-file", cert, "--tls-key-file", key, "--tls-auth-clients", "yes"]
        else:
            args += ["--port", str(self.port)]
        if self.users:
            args += ["--user", "default", "off"]
            for rule in self.users:
                args += ["--user", *rule.split()]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if self.tls is not None or self.users:
                        return  # listening; PING needs the handshake or a login
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"redis-server did not start on {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server(tls: tuple[str, str, str] | None = None,
                 users: tuple[str, ...] = ()) -> Iterator[RedisServer]:
    server = RedisServer(tls, users)
    server.start()
    try:
        yield server
    finally:
        server.kill()
