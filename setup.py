"""Package discovery. `kernels/` and `models/` install as `vlm_sdk.kernels` and `vlm_sdk.models`
(pyproject's package-dir); every package below them and below `vlm_sdk/` is found here, so a new
model family folder cannot be missing from the wheel (tests/structure/test_packaging.py builds one and checks)."""
from setuptools import find_packages, setup


def _mapped(prefix: str, folder: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(folder)]


setup(packages=find_packages(include=["vlm_sdk", "vlm_sdk.*"])
      + _mapped("vlm_sdk.kernels", "kernels") + _mapped("vlm_sdk.models", "models"))
