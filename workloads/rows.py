"""Reading dataset files (``.jsonl``, ``.json`` list, ``.parquet``) into rows, with clear errors
for a missing file, a malformed line and missing columns."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, NotFound

SUFFIXES = (".jsonl", ".json", ".parquet")
"""File kinds the loaders read."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a dataset file as a dict. ``NotFound`` for a missing file,
    ``InvalidRequest`` for an unknown suffix, a malformed file or no rows."""
    if not path.is_file():
        raise NotFound("dataset file not found", path=str(path))
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InvalidRequest("dataset file must be .jsonl, .json or .parquet", path=str(path))
    rows: list[Any]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise InvalidRequest(
                "not a readable parquet file", path=str(path), error=str(exc)
            ) from None
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest("not a JSON file", path=str(path), error=str(exc)) from None
        if not isinstance(rows, list):
            raise InvalidRequest("a .json dataset must hold a list of rows", path=str(path))
    else:
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise InvalidRequest(
                        "malformed JSON line", path=str(path), line=lineno, error=str(exc)
                    ) from None
    if not rows:
        raise InvalidRequest("dataset file has no rows", path=str(path))
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InvalidRequest("every row must be an object", path=str(path), row=i)
    return rows


def require_columns(rows: list[dict[str, Any]], columns: Sequence[str], path: Path) -> None:
    """``InvalidRequest`` naming the missing columns (and the first row missing one)."""
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        if missing:
            raise InvalidRequest(
                f"dataset file lacks column(s) {', '.join(missing)}",
                path=str(path),
                row=i,
                missing=missing,
                required=list(columns),
            )
