"""The tests mirror the source: every package of vlm_sdk has its folder under tests/ (tests/plan for
vlm_sdk/plan, tests/executor for vlm_sdk/executor, ...), every folder under tests/ is a package's or one
of the few that are not (end-to-end runs, these structure checks, the published configs), and
tests/models/ has a folder only for a folder of models/. A new package without tests, or tests filed
under another layer's folder (the planner's once sat in tests/engine), shows here."""
from __future__ import annotations

from pathlib import Path

from helpers import REPO, TESTS

# folders under tests/ that mirror no package, and why
NOT_A_PACKAGE = {
    "e2e": "whole paths through several layers (LLM -> engine -> ranks -> model), per family",
    "structure": "checks of the repository itself: layers, packaging, this layout",
    "configs": "published config.json files the planner's tests read",
}
# packages tested only through others' tests, and why
TESTED_ELSEWHERE = {
    "testing": "the fixtures themselves: every test runs them",
}


def _packages() -> set[str]:
    """vlm_sdk's subpackages as installed: vlm_sdk/*/ plus kernels/ and models/ (setup.py maps them in)."""
    found = {p.name for p in (REPO / "vlm_sdk").iterdir() if (p / "__init__.py").exists()}
    return found | {"kernels", "models"}


def _folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}


def test_every_package_has_its_test_folder():
    missing = sorted(_packages() - _folders(TESTS) - set(TESTED_ELSEWHERE))
    assert not missing, f"packages with no tests/<name>/ folder: {missing}"


def test_every_test_folder_is_a_packages():
    strays = sorted(_folders(TESTS) - _packages() - set(NOT_A_PACKAGE))
    assert not strays, f"folders under tests/ that mirror no vlm_sdk package: {strays}"


def test_exemptions_are_still_needed():
    """An exemption whose reason went away (the package gained a test folder, or is gone) is dropped."""
    assert not set(TESTED_ELSEWHERE) & _folders(TESTS)
    assert set(TESTED_ELSEWHERE) <= _packages()
    assert not set(NOT_A_PACKAGE) & _packages()


def test_model_test_folders_mirror_models():
    models = _folders(REPO / "models")
    strays = sorted(_folders(TESTS / "models") - models)
    assert not strays, f"tests/models/ folders with no models/ folder: {strays}"
