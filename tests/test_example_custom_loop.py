"""``examples/custom_loop.py`` runs on 2 self-spawned gloo ranks and its loss falls."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_loop_example_loss_falls():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_loop.py")], env=env,
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) >= 4, proc.stdout
    assert losses[-1] < 0.5 * losses[0], losses
    assert "done:" in proc.stdout
