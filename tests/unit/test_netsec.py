"""flywheel/netsec.py and what the launcher does with it: keys, Redis credentials, masking."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flywheel.cli import main as cli
from flywheel.config import ConfigError, RedisConfig, SecurityConfig, load_config, mask_credentials
from flywheel.launcher import LocalLaunch
from flywheel.netsec import check_keys, create_keys, redis_client, redis_password


def test_masked_urls_keep_everything_but_the_password() -> None:
    assert mask_credentials("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert (
        mask_credentials("at redis://:pw@h:1/0 and rediss://u:p@x/1") == "at redis://:***@h:1/0 and rediss://u:***@x/1"
    )
    assert mask_credentials("tcp://127.0.0.1:5555 redis://h:1/0") == "tcp://127.0.0.1:5555 redis://h:1/0"


def test_config_errors_never_show_a_password() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--redis.url", "redis://:hunter2@h:1/0", "--redis.password_file", "/x"])
    assert "keep one of them" in str(err.value) and "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="redis.username needs a password"):
        load_config(["--redis.username", "fw"])


def test_keys_are_made_once_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["keys", str(tmp_path / "k")]) == 0
    keys = tmp_path / "k"
    assert (keys / "authorized" / "client.key").read_text() == (keys / "client.key").read_text()
    assert (keys / "server.key_secret").stat().st_mode & 0o077 == 0
    assert cli(["keys", str(keys)]) == 2  # never overwritten
    assert "already holds CURVE keys" in capsys.readouterr().err
    assert create_keys(keys, reuse=True) == keys
    sec = SecurityConfig(curve=True, keys_dir=str(keys))
    check_keys(sec, server=True)
    check_keys(sec, server=False)
    with pytest.raises(ValueError, match="security.keys_dir is unset"):
        check_keys(SecurityConfig(curve=True), server=False)
    (keys / "client.key_secret").unlink()  # a server-only copy: clients cannot use it
    check_keys(sec, server=True)
    with pytest.raises(ValueError, match="client.key_secret"):
        check_keys(sec, server=False)


def test_password_file_is_read_and_checked(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("pa ss\n")
    rcfg = RedisConfig(url="redis://127.0.0.1:1/0", password_file=str(f), username="fw")
    assert redis_password(rcfg) == "pa ss"
    pool = redis_client(rcfg).connection_pool.connection_kwargs
    assert (pool["password"], pool["username"]) == ("pa ss", "fw")
    f.write_text("\n")
    with pytest.raises(ValueError, match="must hold one line"):
        redis_password(rcfg)
    with pytest.raises(ValueError, match="No such file"):
        redis_password(RedisConfig(password_file=str(tmp_path / "missing")))


@pytest.mark.parametrize("user", [None, "fw"], ids=["requirepass", "acl_user"])
def test_flywheel_run_makes_keys_and_a_private_redis_with_the_password(tmp_path: Path, user: str | None) -> None:
    pw = tmp_path / "pw"
    pw.write_text("launcher-secret\n")
    as_user = ["--redis.username", user] if user else []
    cfg = load_config(
        ["--launch.run_dir", str(tmp_path / "run"), "--launch.services", "[redis]", "--train.model", "m"]
        + ["--security.curve", "true", "--redis.password_file", str(pw), *as_user]
    )
    launch = LocalLaunch(cfg)
    try:
        launch._prepare()
        flags = launch.overrides
        keys_dir = flags[flags.index("--security.keys_dir") + 1]
        assert Path(keys_dir) == launch.run_dir / "keys"
        check_keys(SecurityConfig(curve=True, keys_dir=keys_dir), server=True)
        url = flags[flags.index("--redis.url") + 1]
        assert launch.redis is not None
        assert "launcher-secret" not in url and "launcher-secret" not in str(launch.redis.proc.args)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(100).startswith(b"-NOAUTH")
        client = redis_client(load_config(["--redis.url", url, "--redis.password_file", str(pw), *as_user]).redis)
        assert client.ping()
        assert client.acl_whoami() == (user or "default")
    finally:
        launch._shutdown()
