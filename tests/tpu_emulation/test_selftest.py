"""`autoxla doctor --selftest` in emulated mode, as a user runs it (its own process)."""
import os
import subprocess
import sys


def test_doctor_selftest_passes_in_emulated_mode(xla_devices):
    out = subprocess.run([sys.executable, "-m", "AutoXLA.cli", "doctor", "--selftest"],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "Pallas interpret mode" in lines[0]
    for path in ("xla_flash_attention", "splash_attention", "int8 matmul", "int4 matmul",
                 "W8A8 matmul"):
        line = next(line for line in lines if path in line)
        assert line.strip().startswith("PASS") and "kernel call(s) traced" in line, line
