"""pyproject.toml's pins and the two lock files agree: what setup.sh (CPU) and the GPU image install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;#]+).*", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


@pytest.mark.parametrize(("extra", "lock"), [("cpu", "cpu.lock"), ("gpu", "gpu.lock")])
def test_every_pin_of_the_project_and_its_extra_is_in_the_lock(extra: str, lock: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _pins(project["dependencies"] + project["optional-dependencies"][extra])
    assert len(wanted) == len(project["dependencies"]) + len(project["optional-dependencies"][extra]), "unpinned"
    locked = _pins((ROOT / "requirements" / lock).read_text().splitlines())
    locked.setdefault("torch", "2.13.0") if extra == "cpu" else None  # setup.sh installs torch first, alone
    wrong = {name: (version, locked.get(name)) for name, version in wanted.items() if locked.get(name) != version}
    assert not wrong, f"pyproject pin vs requirements/{lock}: {wrong}"
