"""The package's import structure, as pyproject.toml's import-linter contracts declare it: a room
imports only rooms below it in the layer order, and no import cycle, among rooms or among the
modules of one (docs/architecture.md says why the order is what it is)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    config = (ROOT / "pyproject.toml").read_text()
    assert "ignore_imports" not in config, "the contracts list no exceptions (docs/architecture.md)"
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout, out.stdout[-2000:]


# torch.distributed's importers (a subpackage of torch, which import-linter's forbidden contracts
# cannot name): the dtensor runtime, and the training checkpoints' torch.distributed.checkpoint
# (to move under the runtimes with issue 44's checkpoint step).
DISTRIBUTED_IMPORTERS = {"AutoXLA/saving/training.py"}
DISTRIBUTED_PACKAGES = ("AutoXLA/runtimes/dtensor/",)


def _imported_modules(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_torch_distributed_only_in_the_dtensor_runtime():
    found = set()
    for path in sorted((ROOT / "AutoXLA").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        modules = _imported_modules(ast.parse(path.read_text(), relative))
        if any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in modules):
            found.add(relative)
    outside = {f for f in found if not f.startswith(DISTRIBUTED_PACKAGES)}
    assert outside == DISTRIBUTED_IMPORTERS, outside
    assert any(f.startswith(DISTRIBUTED_PACKAGES) for f in found)   # the check sees imports


def test_the_package_root_stays_small():
    """At most six modules at AutoXLA/'s root: everything else lives in a room by its role."""
    modules = sorted(p.name for p in (ROOT / "AutoXLA").glob("*.py"))
    assert len(modules) <= 6, modules


def test_the_package_imports_itself_at_module_level():
    """No import of AutoXLA's own modules inside a function: where a reader looks for a module's
    dependencies, and no lazy import left to hide a cycle (import-linter would see one anyway)."""
    inside = []
    for path in sorted((ROOT / "AutoXLA").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (
                        node.level or (node.module or "").split(".")[0] == "AutoXLA"):
                    inside.append(f"{path.relative_to(ROOT)}:{node.lineno} {fn.name}")
                elif isinstance(node, ast.Import) and any(
                        a.name.split(".")[0] == "AutoXLA" for a in node.names):
                    inside.append(f"{path.relative_to(ROOT)}:{node.lineno} {fn.name}")
    assert not inside, inside


def test_the_users_choices_are_read_in_one_place():
    """quantization_config, attn_implementation and sharding_strategy are read from the loader's
    options by modeling/choices.py alone (modeling/options.py validates them): every step after
    reads the decided values."""
    keywords = {"quantization_config", "attn_implementation", "sharding_strategy"}
    readers = set()
    for path in sorted((ROOT / "AutoXLA").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in keywords
                    and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                    and node.value.id == "opts"):
                readers.add(str(path.relative_to(ROOT)))
    assert readers == {"AutoXLA/modeling/choices.py"}, readers


def test_the_models_state_has_one_holder():
    """What AutoXLA records on a model (plan, mesh, quantization report, last generate, load
    stats, wrapped module) is written by AutoXLA/state.py alone, which sets the holder and the
    attribute users read in one step, and read through the holder: no ``autoxla_plan``-style
    attribute is read or written anywhere else in the package (getattr with the name included)."""
    from AutoXLA.state import LEGACY_NAMES

    names = set(LEGACY_NAMES.values())
    found = []
    for path in sorted((ROOT / "AutoXLA").rglob("*.py")):
        if path.name == "state.py" and path.parent.name == "AutoXLA":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, found
