"""A private redis-server for one run (launcher, tests, benchmarks): AOF on, free port, and a
password (``requirepass``, or an ACL user) when one is given."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from flywheel.procs import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quoted(value: str) -> str:
    """A redis.conf argument: double-quoted, so spaces and quotes in a password survive."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """Starts ``redis-server`` with append-only persistence; stops only the process it started.

    With ``password``: clients must AUTH, as the default user (``requirepass``) or, with
    ``username``, as that ACL user (all rights; the default user is switched off). The password
    goes into a 0600 config file in the data directory, never onto the command line."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        appendfsync: str = "everysec",
        aof_rewrite_min_mb: int = 1024,
        bind: str = "127.0.0.1",
        password: str | None = None,
        username: str | None = None,
        ready_timeout_s: float = 10.0,
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server) or set redis.url")
        self._own_dir = data_dir is None
        self.dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="flywheel-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        # what a restart starts again with (``restarted``)
        self._settings: dict[str, Any] = dict(
            appendfsync=appendfsync,
            aof_rewrite_min_mb=aof_rewrite_min_mb,
            bind=bind,
            password=password,
            username=username,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"  # never with credentials: it is shown and logged
        self.password, self.username = password, username if password is not None else None
        args = [
            exe,
            *self._auth_config(),
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
            # each rewrite forks and rewrites the dataset: at the hub's write rates Redis's 64 MB
            # meant one every few seconds, each a latency spike (config: redis.aof_rewrite_min_mb)
            "--auto-aof-rewrite-min-size",
            f"{aof_rewrite_min_mb}mb",
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
        # Its own session, as every service has: Ctrl-C in a terminal signals the launcher's
        # process group, and Redis must outlive the services' drain, stopped last by its owner.
        # Its owner's death (even kill -9) stops it cleanly, rather than leave it holding the
        # port and the AOF directory a restarted run needs.
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
        try:
            self._wait_ready(timeout_s=ready_timeout_s)
        except BaseException:  # nothing left behind holding the port (or loading the AOF)
            self.stop()
            raise

    def _auth_config(self) -> list[str]:
        """The config file holding the password (it must be redis-server's first argument)."""
        if self.password is None:
            return []
        if self.username not in (None, "default"):
            lines = ["user default off", f"user {_quoted(self.username)} on {_quoted('>' + self.password)} ~* &* +@all"]
        else:
            lines = [f"requirepass {_quoted(self.password)}"]
        path = self.dir / "auth.conf"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return [str(path)]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_timeout=1.0)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                client.ping()
                client.close()
                return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):  # not up, slow, or loading
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s") from None
                time.sleep(0.02)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client that authenticates when the server wants it."""
        kwargs.setdefault("socket_timeout", 10.0)
        if self.password is not None:
            kwargs.setdefault("password", self.password)
            kwargs.setdefault("username", self.username)
        return redis.Redis.from_url(self.url, **kwargs)

    def stop(self) -> None:
        self._stop_process()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def restarted(self, ready_timeout_s: float) -> RedisServer:
        """Stop this server (if it still runs) and start another with its settings on its port and
        directory: it reloads the AOF, and every client reconnects."""
        self._stop_process()
        again = RedisServer(self.dir, port=self.port, ready_timeout_s=ready_timeout_s, **self._settings)
        again._own_dir = self._own_dir
        return again

    def _stop_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
