"""Request traces shipped inside the package (sources and licences in README.md here), and
the one reader of Azure-LLM-style trace CSVs, so that tests, benchmarks and commands
replay real arrivals from any checkout or install."""

from __future__ import annotations

import csv
from datetime import datetime
from importlib import resources
from pathlib import Path

#: The Azure LLM 2023 conversation trace (CC-BY 4.0).
AZURE_CONV = "azure_llm_2023_conv"
SHIPPED = (AZURE_CONV,)
#: `--trace` help of every command that replays a trace.
TRACE_HELP = (
    f"request trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), or {AZURE_CONV} for "
    "the shipped Azure conversation trace"
)


def trace_path(trace: str | Path) -> Path:
    """The path of a shipped trace given its name, or `trace` itself as a path."""
    if str(trace) in SHIPPED:
        return Path(str(resources.files(__package__).joinpath(f"{trace}.csv")))
    return Path(trace)


def read_trace(trace: str | Path) -> list[tuple[float, int, int]]:
    """`(seconds since the first request, context tokens, generated tokens)` of a trace CSV
    (`TIMESTAMP, ContextTokens, GeneratedTokens`), in arrival order; `trace` is a path or a
    shipped trace's name."""
    path = trace_path(trace)
    needed = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    rows = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not needed <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: expected a CSV with columns {sorted(needed)}")
        try:
            for row in reader:
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                rows.append(
                    (stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
                )
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    if not rows:
        raise ValueError(f"{path}: no requests")
    start = min(r[0] for r in rows)
    return sorted((t - start, c, g) for t, c, g in rows)
