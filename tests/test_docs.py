"""What the README claims about testing matches the suite (issue 43: its Status paragraph still
said the Pallas kernels were not exercised, long after the emulated-kernel tests ran them)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^Status: (.*?)\n\n", readme, flags=re.S | re.M)
    assert match, "README.md has no Status paragraph"
    return " ".join(match.group(1).split())


def test_readme_status_says_how_the_pallas_kernels_are_tested():
    status = _status()
    assert "not exercised" not in status and "only the arguments" not in status
    # Each claim names where the suite shows it; those tests exist and run the real kernels.
    assert "interpret mode" in status and "tests/tpu_emulation" in status
    emulated = ROOT / "tests" / "tpu_emulation"
    for module, kernel_call in (("test_attention.py", "splash_attention"),
                                ("test_quantized.py", "use_pallas=True"),
                                ("test_lowering.py", "lower")):
        assert kernel_call in (emulated / module).read_text(), f"{module} no longer runs {kernel_call}"
    assert "lowering check" in status
