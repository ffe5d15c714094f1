"""`autoxla doctor` in the dtensor runtime's environment (no torch_xla): it says which runtime
runs here and why the other does not, and succeeds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_doctor_reports_the_dtensor_runtime_without_torch_xla():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "AutoXLA.cli", "doctor", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    rt = r["runtimes"]
    assert rt["default"] == "dtensor" and rt["dtensor"]["why_not"] is None
    assert "torch_xla is not installed" in rt["xla"]["why_not"]
    assert rt["dtensor"]["device_types"]["cpu"] is None and rt["dtensor"]["note"] == ""
    assert not r["devices"]["ok"] and "torch_xla" in r["devices"]["error"]
