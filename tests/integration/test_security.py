"""Security of the links: CURVE on the hub and the weight sync, Redis AUTH, loopback binds.

One hub (a real process, a real redis-server with a password) serves every test of the module:
an authorised generator gets leases and acks; peers without keys or with a key the hub does not
know get nothing back, and the hub takes nothing from them.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from flywheel import config as config_module
from flywheel.config import FlywheelConfig, SecurityConfig, SyncConfig
from flywheel.netsec import create_keys
from flywheel.procs import Service, wait_for_state_file
from flywheel.redis_server import RedisServer, free_port
from flywheel.store import RunKeys
from flywheel.wire import Register, RewardRegister, encode
from generators.hub_link import HubLink
from tests.conftest import ROOT, wait_until
from tests.integration.handgen import make_chunk

PASSWORD = 'correct horse "battery" staple'
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass
class SecuredHub:
    keys: Path  # the run's keys
    stranger: Path  # the server's public key and a client keypair the hub never authorised
    redis: RedisServer
    hub: Service
    ports: dict[str, int]

    @property
    def gen_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['generator_port']}"

    @property
    def reward_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['reward_port']}"

    def metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.ports['metrics_port']}/metrics"
        return str(urllib.request.urlopen(url, timeout=5).read().decode())

    def metric(self, name: str) -> float:
        for line in self.metrics_text().splitlines():
            if line.startswith(f"flywheel_hub_{name} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def stranger_keys(keys: Path, where: Path) -> Path:
    """Keys of a peer that knows the server's public key but holds a client key of its own."""
    create_keys(where)
    shutil.copy(keys / "server.key", where / "server.key")
    return where


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, prompts_jsonl: Path) -> Iterator[SecuredHub]:
    tmp = tmp_path_factory.mktemp("secured")
    keys = create_keys(tmp / "keys")
    stranger = stranger_keys(keys, tmp / "stranger")
    password_file = tmp / "redis.password"
    password_file.write_text(PASSWORD + "\n")
    server = RedisServer(tmp / "redis", password=PASSWORD)
    state = tmp / "hub.json"
    # no --hub.host: the hub binds its default
    args = [
        "--redis.url", server.url, "--redis.password_file", str(password_file),
        "--data.path", str(prompts_jsonl), "--data.tokenizer", str(tokenizer_dir),
        "--hub.generator_port", "0", "--hub.reward_port", "0", "--hub.metrics_port", "0",
        "--hub.state_file", str(state), "--async.groups_per_step", "2", "--data.n_samples_per_prompt", "2",
        "--security.curve", "true", "--security.keys_dir", str(keys),
    ]  # fmt: skip
    hub = Service("hub", "buffer", args, tmp, env={"PYTHONPATH": str(ROOT)})
    try:
        ports = wait_for_state_file(state, hub, timeout_s=90)
        yield SecuredHub(keys, stranger, server, hub, ports)
    finally:
        hub.stop()
        server.stop()
        if hub.returncode not in (0, None):
            print(hub.tail(40))


class Intruder:
    """A raw DEALER that connects with the given keys (None: no CURVE at all) and watches its
    own handshake through a socket monitor."""

    def __init__(self, address: str, identity: str, keys: Path | None) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A peer whose handshake already failed may have no pipe left to queue a message into, and
        # a DEALER's send then waits for one (a CI run waited past the test's timeout): bounded.
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.identity = identity
        if keys is not None:
            server_public, _ = zmq.auth.load_certificate(keys / "server.key")
            public, secret = zmq.auth.load_certificate(keys / "client.key_secret")
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret or b"")
        self.monitor: zmq.Socket[bytes] = self.sock.get_monitor_socket()
        self.sock.connect(address)
        self.events: list[str] = []
        self.received: list[bytes] = []

    def watch(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            while self.monitor.poll(0):
                self.events.append(str(zmq.Event(recv_monitor_message(self.monitor)["event"]).name))
            if self.sock.poll(20):
                self.received.append(self.sock.recv())

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def test_authorised_generator_is_served_and_its_chunks_stored(secured: SecuredHub) -> None:
    link = HubLink(
        secured.gen_address,
        "good",
        "m",
        1,
        heartbeat_s=0.2,
        security=SecurityConfig(curve=True, keys_dir=str(secured.keys)),
    )
    try:
        link.register(0)
        leases = wait_until(lambda: link.poll(50).leases, 30, "a lease over CURVE")
        link.send_chunks([make_chunk(leases[0], 0, 0, version=0, final=True)])
        wait_until(lambda: link.poll(50).acked, 15, "the chunk's ack")
    finally:
        link.close()
    # The ack follows the hub's Redis write, made with the password: the chunk is there.
    stored = secured.redis.client().hlen(RunKeys("flywheel").group(leases[0].group_id))
    assert stored > 0


def test_peers_without_an_authorised_key_get_nothing(secured: SecuredHub) -> None:
    """No keys, or a key the hub never authorised, on both hub ports: the handshake fails, no
    reply comes back, and the hub takes in no message (no registration, nothing rejected)."""
    before_refused = secured.metric("peers_refused_total")
    intruders = {
        (port, kind): Intruder(address, f"intruder-{port}-{kind}", keys)
        for port, address in (("gen", secured.gen_address), ("reward", secured.reward_address))
        for kind, keys in (("nokey", None), ("stranger", secured.stranger))
    }
    try:
        for (port, _), intruder in intruders.items():
            ident = intruder.identity
            msg = Register(generator_id=ident, model="m", capacity=8, weight_version=0)
            with contextlib.suppress(zmq.Again):  # not even queued: nothing can reach the hub either
                intruder.sock.send(encode(msg if port == "gen" else RewardRegister(worker_id=ident, capacity=8)))
        for intruder in intruders.values():
            intruder.watch(0.4)  # 1.6 s in all
        for (port, kind), intruder in intruders.items():
            assert intruder.received == [], f"{port}/{kind} got a reply"
            assert "CONNECTED" in intruder.events, f"{port}/{kind} never reached the hub: {intruder.events}"
            # a stranger's key is refused by the hub's ZAP handler; a peer without keys fails the
            # mechanism exchange (libzmq reports it as PROTOCOL or NO_DETAIL)
            failed = ["HANDSHAKE_FAILED_AUTH"] if kind == "stranger" else [e for e in intruder.events if "FAILED" in e]
            assert failed and failed[0] in intruder.events, f"{port}/{kind}: {intruder.events}"
            assert "HANDSHAKE_SUCCEEDED" not in intruder.events
    finally:
        for intruder in intruders.values():
            intruder.close()
    registered = secured.redis.client().hkeys(RunKeys("flywheel").generators)
    assert not [g for g in registered if g.startswith(b"intruder")]
    assert secured.metric("reward_workers") == 0
    assert secured.metric("peers_refused_total") >= before_refused + 2  # the two strangers, counted
    assert "rejected_total{" not in secured.metrics_text()  # nothing got far enough to be rejected


def test_redis_refuses_clients_without_the_password(secured: SecuredHub) -> None:
    with socket.create_connection(("127.0.0.1", secured.redis.port), timeout=5) as s:
        s.sendall(b"GET fw:{flywheel}:version\r\n")
        assert s.recv(200).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(secured.redis.url, password="wrong", socket_timeout=5).ping()
    url = secured.redis.url.replace("redis://", f"redis://:{urllib.parse.quote(PASSWORD, safe='')}@")
    assert redis.Redis.from_url(url, socket_timeout=5).ping()  # the URL form carries it too
    assert PASSWORD not in secured.hub.tail(400)


def _listening(port: int) -> set[str]:
    """Local addresses a TCP port listens on, from /proc/net/tcp (and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.add("127.0.0.1" if addr == "0100007F" else addr)
    return found


def test_every_service_binds_loopback_unless_configured(secured: SecuredHub) -> None:
    defaults = FlywheelConfig()
    assert defaults.hub.host == defaults.sync.host == defaults.rm.host == "127.0.0.1"
    hosts = [k for k, *_ in config_module.reference() if k.endswith(".host") or k.endswith("_host")]
    assert sorted(hosts) == ["hub.host", "rm.host", "sync.host"], "a new bind address: default it to 127.0.0.1"
    assert defaults.reward.hub_address.startswith("tcp://127.0.0.1:")
    assert defaults.generator.hub_address.startswith("tcp://127.0.0.1:")
    assert not defaults.security.curve  # an option; the launcher makes keys when it is on
    # The running hub, started without --hub.host: every port it opened listens on loopback only.
    for name in ("generator_port", "reward_port", "metrics_port"):
        assert _listening(secured.ports[name]) == {"127.0.0.1"}, name
    assert _listening(secured.redis.port) == {"127.0.0.1"}, "the private redis-server"


def test_weight_sync_serves_only_authorised_generators(secured: SecuredHub) -> None:
    from generators.sync_link import SyncLink
    from learner.weight_sync import WeightBroadcaster

    sec = SecurityConfig(curve=True, keys_dir=str(secured.keys))
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port())
    wb = WeightBroadcaster(cfg, security=sec)
    good = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "good", 1, security=sec)
    stranger = SyncLink(
        "127.0.0.1",
        cfg.announce_port,
        cfg.join_port,
        "stranger",
        1,
        security=SecurityConfig(curve=True, keys_dir=str(secured.stranger)),
    )
    nokey = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "nokey", 1)
    links = [good, stranger, nokey]
    try:

        def joined() -> bool:
            for link in links:
                link.join(0, every_s=0.1)
            wb.poll(50)
            return "good" in wb.members

        wait_until(joined, 15, "the authorised generator's SyncJoin")
        for _ in range(10):  # the others keep trying for a while
            joined()
        assert set(wb.members) == {"good"}

        def heard() -> int:  # a PUB drops what it sends before a subscription arrives: repeat
            wb.pub.send(b"announcement")
            return good.sub.poll(100)

        wait_until(heard, 10, "the announcement at the authorised generator")
        assert stranger.sub.poll(200) == 0 and nokey.sub.poll(0) == 0
    finally:
        for link in links:
            link.close()
        wb.close()
