"""The README's first command: the hub demo runs end to end and shows what flows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hub_demo_runs() -> None:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "demo", "--steps", "4", "--generators", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "step 3: v3, 4 groups" in out.stdout
    assert "flywheel_hub_tokens_in_total" in out.stdout  # the /metrics scrape
