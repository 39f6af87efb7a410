"""``python -m bench.edge_size``: what ``pip install ql3`` puts on disk, with and without extras.

Builds the wheel of this checkout (``pip wheel --no-deps --no-build-isolation``: hatchling
is in the development venv), then for each variant creates a fresh venv, installs the
wheel there and measures its ``site-packages`` the way ``du`` does (allocated blocks, hard
links once), less what the same measure gives for an empty venv (pip itself). Every
third-party package is pinned to its version in ``requirements/dev.txt``, the lock the
development venv is built from.

Variants: ``ql3`` (no extras: the SQLite edge shim, with AI or without: the AI feature is
in the same wheel and needs nothing more), ``ql3[gateway]`` (AI with the HTTP provider
adapter: httpx) and ``ql3[all]`` (PostgreSQL driver and pool, Redis with hiredis, the
Prometheus client, httpx). Not part of ``make bench`` (it needs the
package index, not the servers); ``tests/py/test_edge_install.py`` uses its helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK = REPO_ROOT / "requirements" / "dev.txt"

SERVER_DISTRIBUTIONS = (
    "psycopg",
    "psycopg-binary",
    "psycopg-pool",
    "redis",
    "hiredis",
    "httpx",
    "prometheus-client",
)
"""What the extras bring and the bare package must not."""

_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)")


def locked_pins(lock: Path = LOCK) -> dict[str, str]:
    """``{normalized name: version}`` of every package the lock pins."""
    pins: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            pins[normalize(match["name"])] = match["version"]
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_python() -> str:
    """The interpreter the development venv was made from (``python3 -m venv`` with it)."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def run(args: Sequence[str | Path]) -> str:
    """The command's stdout; a failure raises with its output."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, args))} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


def build_wheel(out_dir: Path) -> Path:
    """The wheel of this checkout, built with the development venv's hatchling."""
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", out_dir, REPO_ROOT],
    )  # fmt: skip
    (wheel,) = out_dir.glob("ql3-*.whl")
    return wheel


def make_venv(path: Path) -> Path:
    """A fresh venv at ``path``; its python."""
    run([base_python(), "-m", "venv", path])
    return path / "bin" / "python"


def site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(run([python, "-c", code]).strip())


def install(python: Path, requirements: Iterable[str], constraints: Path | None = None) -> None:
    args: list[str | Path] = [python, "-m", "pip", "install", "-q", *requirements]
    if constraints is not None:
        args += ["-c", constraints]
    run(args)


def installed(python: Path) -> dict[str, str]:
    """``pip list`` of the venv: ``{normalized name: version}``."""
    listed = json.loads(run([python, "-m", "pip", "list", "--format=json"]))
    return {normalize(item["name"]): item["version"] for item in listed}


def du_bytes(root: Path) -> int:
    """Disk usage of ``root`` as ``du`` counts it: allocated blocks, each inode once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in [".", *files]:
            st = os.lstat(os.path.join(directory, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def constraints_file(directory: Path) -> Path:
    """The lock's pins as a pip constraints file (pip refuses hashes in constraints)."""
    path = directory / "constraints.txt"
    path.write_text("".join(f"{name}=={version}\n" for name, version in locked_pins().items()))
    return path


@dataclass(frozen=True)
class Variant:
    """One install: its ``site-packages`` less an empty venv's, and what pip lists."""

    bytes: int
    packages: list[str]


VARIANTS = {"ql3": "", "ql3[gateway]": "[gateway]", "ql3[all]": "[all]"}


def measure(work: Path) -> dict[str, Variant]:
    wheel = build_wheel(work / "wheel")
    constraints = constraints_file(work)
    empty = du_bytes(site_packages(make_venv(work / "empty")))
    results: dict[str, Variant] = {}
    for n, (label, extras) in enumerate(VARIANTS.items()):
        python = make_venv(work / f"venv{n}")
        install(python, [f"{wheel}{extras}"], constraints)
        packages = sorted(set(installed(python)) - {"pip", "setuptools"})
        results[label] = Variant(du_bytes(site_packages(python)) - empty, packages)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.edge_size", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ql3-edge-size-") as tmp:
        results = measure(Path(tmp))
    if args.json:
        print(json.dumps({label: asdict(v) for label, v in results.items()}, indent=2))
        return 0
    for label, variant in results.items():
        print(f"{label:13} {variant.bytes / 1e6:7.1f} MB  {', '.join(variant.packages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
