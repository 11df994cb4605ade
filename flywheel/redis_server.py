"""A private redis-server for one run (launcher, tests, benchmarks): AOF on, free port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Starts ``redis-server`` with append-only persistence; stops only the process it started."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        appendfsync: str = "everysec",
        bind: str = "127.0.0.1",
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server) or set redis.url")
        self._own_dir = data_dir is None
        self.dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="flywheel-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            bind,  # 127.0.0.1 unless a launcher spreads services over machines
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            appendfsync,
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        self.log_path = self.dir / "redis.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s=10.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s") from None
                time.sleep(0.02)

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10.0, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
