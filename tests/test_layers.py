"""The package's import structure, as pyproject.toml's import-linter contracts declare it: a room
imports only rooms below it in the layer order, and no import cycle, among rooms or among the
modules of one (docs/architecture.md says why the order is what it is)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout, out.stdout[-2000:]


def test_the_package_root_stays_small():
    """At most six modules at AutoXLA/'s root: everything else lives in a room by its role."""
    modules = sorted(p.name for p in (ROOT / "AutoXLA").glob("*.py"))
    assert len(modules) <= 6, modules
