"""Spare generators and the standby learner: the launcher's contract with a service held
loaded but idle.

A spare (``generator.standby_file = F``) builds its engine, creates ``F.ready``, and waits for
``F``. When a generator dies, the launcher writes ``F`` (atomically: a temporary file renamed
over it) with the JSON ``{"id": ..., "ack_log": ...}`` of the generator it loses; the spare
reads it and only then connects to the hub and to the learner's weight sync under that id. The
hub takes the registration of a known id as that generator's restart (its leases are re-issued),
and the learner's sync sees a member at an old version and sends it the current weights.

The standby learner (``train.standby_file``) follows the same steps with the id ``learner``:
it imports what a learner start imports, marks itself ready, and on its takeover resumes from
the dead learner's checkpoint.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from flywheel.files import write_atomically

READY_SUFFIX = ".ready"
MAX_TAKEOVER_BYTES = 1 << 16


@dataclass(frozen=True)
class Takeover:
    """Who a spare becomes: the generator id it registers under, and that generator's ack log
    (``learner`` and none for the standby learner)."""

    generator_id: str
    ack_log: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"id": self.generator_id, "ack_log": self.ack_log}).encode()

    @classmethod
    def decode(cls, raw: bytes, source: str) -> Takeover:
        """Parse and check a takeover file; a bad one raises ValueError naming the field."""
        if len(raw) > MAX_TAKEOVER_BYTES:
            raise ValueError(f"{source}: {len(raw)} bytes, more than a takeover holds ({MAX_TAKEOVER_BYTES})")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f'{source}: not JSON ({err}); expected {{"id": "gen0", "ack_log": null}}') from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"id", "ack_log"}
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {sorted(unknown)}; a takeover has id and ack_log")
        gid = data.get("id")
        if not isinstance(gid, str) or not gid or len(gid) > 256:
            raise ValueError(f"{source}: field id must be a generator id (1-256 characters), got {gid!r}")
        ack_log = data.get("ack_log")
        if ack_log is not None and (not isinstance(ack_log, str) or not ack_log):
            raise ValueError(f"{source}: field ack_log must be a path or null, got {ack_log!r}")
        return cls(gid, ack_log)


def ready_path(standby_file: Path) -> Path:
    return standby_file.with_name(standby_file.name + READY_SUFFIX)


def mark_ready(standby_file: Path) -> None:
    """The spare's engine is loaded: it can take a generator's place at once."""
    ready_path(standby_file).touch()


def is_ready(standby_file: Path) -> bool:
    return ready_path(standby_file).exists()


def clear(standby_file: Path) -> None:
    """Before a spare starts: no takeover or ready mark left from an earlier process."""
    standby_file.unlink(missing_ok=True)
    ready_path(standby_file).unlink(missing_ok=True)


def hand_over(standby_file: Path, takeover: Takeover) -> None:
    """Launcher side: tell the spare who it is now (written whole, then renamed into place)."""
    write_atomically(standby_file, takeover.encode())


async def wait_for_takeover(standby_file: Path, poll_s: float = 0.1) -> Takeover:
    """Spare side: wait (without end: a spare waits as long as the fleet is whole; it dies with
    the launcher, its parent) until the launcher hands a generator's place over."""
    while not standby_file.exists():
        await asyncio.sleep(poll_s)
    return Takeover.decode(standby_file.read_bytes(), str(standby_file))
