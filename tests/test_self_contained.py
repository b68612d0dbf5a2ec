"""The repository stands alone: no test, bench, doc command or default reaches outside the
clone, and the shipped trace is what the commands that name it read."""

from __future__ import annotations

import re
from pathlib import Path

from dilaserve.traces import AZURE_CONV, read_trace, trace_path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".cfg", ".txt", ".rs", ""}
# Ways a file could name something beside the clone: a parent-relative path to a sibling
# folder, or a path built by climbing above the repository root from a file in it.
OUTSIDE = [
    re.compile(r"(?<![.\w])\.\./[A-Za-z_]"),
    re.compile(r"parents\[\d+\]\.parent\b"),
    re.compile(r"""['"]shared['"]\s*/"""),
]


def repository_files() -> list[Path]:
    skip = {".git", "target", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
    skip |= {".venv", "venv", "build", "dist"}  # what a user's own set-up may put there
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and not skip & set(p.relative_to(ROOT).parts)
        and p.suffix in TEXT_SUFFIXES
        and p.stat().st_size < 2_000_000
    ]


def test_nothing_in_the_repository_reaches_outside_it():
    offenders = []
    for path in repository_files():
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        for pattern in OUTSIDE:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_conversation_trace_ships_inside_the_package():
    path = trace_path(AZURE_CONV)
    assert path.is_file()
    assert ROOT in path.resolve().parents or "site-packages" in path.parts
    assert (path.parent / "README.md").read_text().count("CC-BY 4.0") == 1
    trace = read_trace(AZURE_CONV)
    assert len(trace) == 19366 and trace[0][0] == 0.0
    assert trace == read_trace(path)
