"""tests/vectors is an unchanged copy of the project's shared vectors.

The tests read the vendored copy, so a clone without the shared folder runs them all. Where
the shared folder is present (``../shared`` beside the repository, as in CI, or the folder
``QL3_SHARED_DIR`` names), every shared vector file must be in tests/vectors with the same
bytes, and tests/vectors must hold no vector file the shared folder lacks. Without it these
tests are skipped: a user's clone has no shared folder, and needs none.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENDORED = REPO / "tests" / "vectors"
OWN_FILES = {"README.md"}
"""Files of tests/vectors that are not copies (paths relative to tests/vectors)."""


def shared_vectors() -> Path:
    """The shared vectors folder; skips the test when it is absent and was not asked for."""
    configured = os.environ.get("QL3_SHARED_DIR")
    folder = Path(configured) / "vectors" if configured else REPO.parent / "shared" / "vectors"
    if not folder.is_dir():
        if configured:
            pytest.fail(f"QL3_SHARED_DIR has no vectors folder: {folder}", pytrace=False)
        pytest.skip(f"no shared vectors at {folder}: only a checkout beside ../shared has them")
    return folder


def files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_every_shared_vector_file_is_vendored_with_the_same_bytes() -> None:
    shared = shared_vectors()
    names = files(shared)
    assert names, f"{shared} holds no files"
    missing = sorted(names - files(VENDORED))
    assert not missing, f"shared vector files missing from tests/vectors: {missing}"
    differing = sorted(n for n in names if (shared / n).read_bytes() != (VENDORED / n).read_bytes())
    assert not differing, f"tests/vectors differs from {shared} in: {differing}"


def test_tests_vectors_holds_no_file_the_shared_folder_lacks() -> None:
    extra = sorted(files(VENDORED) - files(shared_vectors()) - OWN_FILES)
    assert not extra, f"tests/vectors holds files the shared vectors do not: {extra}"


def test_the_vendored_vectors_are_there_without_the_shared_folder() -> None:
    # Never skipped: what the other vector tests read must be in the repository itself.
    names = files(VENDORED)
    for name in ("jcs.json", "digest.json", "identity.json", "rfc8785/README.md"):
        assert name in names, name
    inputs = {n.split("/")[-1] for n in names if n.startswith("rfc8785/input/")}
    outputs = {n.split("/")[-1] for n in names if n.startswith("rfc8785/output/")}
    assert inputs and inputs == outputs and "values.json" in inputs
