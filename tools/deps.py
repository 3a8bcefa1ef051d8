"""What `./run` installs, and whether it is installed already, without importing any of it.

Three levels, each holding the ones before:
    demo  `./run demo`: what the in-process demo imports (pyproject's [tool.vlm_sdk] demo-dependencies)
          and vlm-sdk itself (installed --no-deps)
    core  `./run bench`: vlm-sdk's own dependencies (pyproject's [project] dependencies)
    test  `./run test`: those and the test extra

`check LEVEL` answers in a fraction of a second (what took `./run` 40-60 s was importing ray.serve,
playwright and transformers to see that they import): it reads the installed distributions' metadata
(importlib.metadata) and a stamp file written after the last install, keyed by pyproject.toml, setup.py,
the interpreter and the level. It exits 0 when nothing is to be done, else 1 with the reason on stdout.

    python tools/deps.py check LEVEL | stamp LEVEL | requirements LEVEL | announce LEVEL
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVELS = ("demo", "core", "test")
STAMPS = REPO / ".cache"
# What each level adds, measured from a fresh clone in an empty venv (2 cores, other work running, a
# package index on the local network): downloaded, installed (the venv's size after), pip's time.
# A 50 Mbit/s connection adds about 40 s per 256 MB.
SIZES = {"demo": ("256 MB to download (the CPU torch wheel is 192 MB of it), 1.2 GB installed", "3.5 minutes"),
         "core": ("328 MB more to download (triton for the GPU kernels is most of it; PyAV, llguidance, aiohttp), "
                  "2.3 GB installed in all", "1 minute more"),
         "test": ("189 MB more to download (Ray Serve, Playwright, decord, openai, pytest, ...), 2.9 GB installed "
                  "in all", "2 minutes more")}


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def requirements(level: str) -> list[str]:
    """The requirement strings `level` needs (PEP 508, markers dropped for those that do not apply)."""
    project = _toml(REPO / "pyproject.toml")
    if level == "demo":
        return list(project["tool"]["vlm_sdk"]["demo-dependencies"])
    reqs = list(project["project"]["dependencies"])
    if level == "test":
        reqs += project["project"]["optional-dependencies"]["test"]
    return reqs


def missing(level: str) -> list[str]:
    """The requirements of `level` that no installed distribution satisfies (name and version)."""
    from pip._vendor.packaging.requirements import Requirement
    out = []
    for text in requirements(level):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(f"{req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} does not satisfy {req.specifier}")
    return out


def key(level: str) -> str:
    h = hashlib.sha256()
    for name in ("pyproject.toml", "setup.py"):
        h.update((REPO / name).read_bytes())
    h.update(f"{os.path.realpath(sys.executable)}\n{level}".encode())
    return h.hexdigest()


def check(level: str) -> str | None:
    """Why `level` must be installed, or None when it is."""
    spec = importlib.util.find_spec("vlm_sdk")  # locates the package without running it
    if spec is None or spec.origin is None:
        return "vlm-sdk is not installed"
    if not os.path.realpath(spec.origin).startswith(os.path.realpath(REPO / "vlm_sdk")):
        return f"vlm_sdk is installed from another checkout ({os.path.dirname(spec.origin)})"
    stamped = [lv for lv in LEVELS[LEVELS.index(level):] if (STAMPS / f"installed-{lv}").is_file()
               and (STAMPS / f"installed-{lv}").read_text() == key(lv)]
    if not stamped:
        current = [lv for lv in LEVELS if (STAMPS / f"installed-{lv}").is_file()
                   and (STAMPS / f"installed-{lv}").read_text() == key(lv)]
        if current:
            return f"only the {current[-1]} packages are installed here, not the {level} ones"
        return "first install" if not any((STAMPS / f"installed-{lv}").exists() for lv in LEVELS) else \
            "pyproject.toml or setup.py changed since the last install"
    gone = missing(level)
    return "; ".join(gone) if gone else None


def stamp(level: str) -> None:
    STAMPS.mkdir(exist_ok=True)
    (STAMPS / f"installed-{level}").write_text(key(level))


def announce(level: str) -> str:
    parts = LEVELS[:LEVELS.index(level) + 1]
    sizes = "; ".join(f"{lv}: {SIZES[lv][0]}" for lv in parts)
    times = ", then ".join(SIZES[lv][1] for lv in parts)
    return (f"[run] on a fresh machine this installs {sizes} (pip's progress below); it took {times} here "
            f"(2 cores), plus the download. Packages already installed are kept.")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("check", "stamp", "requirements", "announce") or argv[1] not in LEVELS:
        print(__doc__, file=sys.stderr)
        return 2
    command, level = argv
    if command == "check":
        why = check(level)
        if why:
            print(why)
        return 1 if why else 0
    if command == "stamp":
        stamp(level)
    elif command == "requirements":
        print("\n".join(requirements(level)))
    else:
        print(announce(level))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
