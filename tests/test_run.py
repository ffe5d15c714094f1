"""`./run`'s C core build: only when its sources changed, and never under a running process.

Issue 43: `./run emulated` deleted and rebuilt the library in the checkout on every call, under
any process already running from it. The test runs the real `run` script in a copy of the
checkout's build files whose C sources are one tiny function (compiles in about a second; the
script and setup.py are the project's own, so the logic tested is the real one).
"""
import ctypes
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def _checkout(tmp_path: Path, answer: int) -> Path:
    for name in ("run", "setup.py", "requirements.lock", "requirements-nodeps.lock",
                 "requirements-tpu-emulation.lock"):
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / "csrc" / "include").mkdir(parents=True)
    (tmp_path / "csrc" / "src").mkdir()
    (tmp_path / "csrc" / "include" / "autoxla.h").write_text("int axl_answer(void);\n")
    (tmp_path / "AutoXLA").mkdir()
    _source(tmp_path, answer)
    return tmp_path


def _source(root: Path, answer: int) -> None:
    (root / "csrc" / "src" / "core.c").write_text(
        f"__attribute__((visibility(\"default\"))) int axl_answer(void) {{ return {answer}; }}\n")


def _run(root: Path) -> subprocess.CompletedProcess:
    # AUTOXLA_VENV: this interpreter's environment, the one ./run built (nothing is installed).
    r = subprocess.run(["bash", str(root / "run"), "python", "-c", "pass"], cwd=root,
                       capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                            "AUTOXLA_VENV": sys.prefix})
    assert r.returncode == 0, r.stderr
    return r


def test_the_c_core_is_rebuilt_only_when_its_sources_change(tmp_path):
    root = _checkout(tmp_path, 41)
    library = root / "AutoXLA" / f"_axl_core{SUFFIX}"
    _run(root)
    first = library.stat()
    # A process running from the checkout, with the library mapped.
    running = ctypes.CDLL(str(library))
    assert running.axl_answer() == 41

    _run(root)                                  # nothing changed: the same file, untouched
    again = library.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    _source(root, 42)                           # a source changed: rebuilt, by a rename
    _run(root)
    rebuilt = library.stat()
    assert rebuilt.st_ino != first.st_ino
    # A process starting now loads the new one (this process would get its cached handle).
    fresh = subprocess.run([sys.executable, "-c", "import ctypes, sys; "
                            "print(ctypes.CDLL(sys.argv[1]).axl_answer())", str(library)],
                           capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip() == "42", fresh.stderr
    assert running.axl_answer() == 41           # the running process still has the old, intact
    assert not list((root / "build").glob("c-core.*")), "the build folder was left behind"


def test_the_dtensor_lock_pins_torch_2_14_1_and_every_package_without_torch_xla_or_jax():
    lines = [line.strip() for line in (ROOT / "requirements-dtensor.lock").read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    assert "torch==2.14.1" in pins
    unpinned = [line for line in pins if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^=\s]+", line)]
    assert not unpinned, unpinned
    names = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in pins}   # PEP 503
    assert not names & {"torch-xla", "jax", "jaxlib"}
