"""Every test module can import what it names, on any machine and in any selection of files.

pytest puts a test file's own folder and tests/ (the conftest's) on sys.path; a helper module in
another test folder is importable only when some earlier file of the same run happened to put its
folder there. `tests/e2e/test_cuda.py` once imported `test_internvl_model` inside a test: fine in a
whole-suite run, ModuleNotFoundError when the CUDA tests ran alone on the H100, and never seen on the
CPU, where that test is skipped before its body runs. This reads every import of every test file,
module level and inside functions, and checks each resolves from that file's own sys.path.
"""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _local(top: str, folder: Path) -> bool:
    return (folder / f"{top}.py").exists() or (folder / top / "__init__.py").exists()


def unresolved(path: Path) -> list[str]:
    """Imports of `path` that neither its folder, tests/, nor the installed packages provide."""
    bad = []
    for line, name in _imports(ast.parse(path.read_text(), str(path))):
        top = name.split(".")[0]
        if _local(top, path.parent) or _local(top, TESTS):
            continue
        spec = importlib.util.find_spec(top)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        # a test module found only because another test folder is on this process's sys.path
        if spec is None or (origin is not None and TESTS in origin.parents):
            where = path.relative_to(TESTS) if TESTS in path.parents else path.name
            bad.append(f"{where}:{line}: import {name}")
    return bad


def test_every_test_import_resolves_from_its_own_folder():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100
    bad = [b for f in files for b in unresolved(f)]
    assert not bad, "imports that only work when another test folder is on sys.path:\n" + "\n".join(bad)


def test_the_check_sees_an_import_from_another_test_folder(tmp_path, monkeypatch):
    """The check fails on what failed on the H100: a function-level import of a module that lives in
    another test folder (here on sys.path, as after a whole-suite collection)."""
    monkeypatch.syspath_prepend(str(TESTS / "models" / "internvl"))
    probe = tmp_path / "test_probe.py"
    probe.write_text("import helpers\n\n\ndef test_x():\n    from test_internvl_model import GREEDY\n")
    assert unresolved(probe) == ["test_probe.py:5: import test_internvl_model"]  # helpers: tests/ is on the path


def test_every_test_module_collects_in_a_fresh_process():
    """`pytest -m cuda --collect-only` over the whole suite, in its own process as the device check runs
    it: no collection error (an import that fails at module level, a bad parametrisation)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                          "no:cacheprovider", str(TESTS)], capture_output=True, text=True, timeout=600,
                         cwd=TESTS.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tests/e2e/test_cuda.py::test_internvl_cuda_greedy_equals_cpu_and_profiles" in run.stdout
