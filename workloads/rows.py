"""Reading datasets as users keep them into rows, with clear errors for a missing file, a
malformed line and missing columns: a ``.jsonl`` file, a ``.json`` list, a ``.parquet`` file, or
a directory a 🤗 ``datasets`` ``Dataset``/``DatasetDict`` was saved to (``save_to_disk``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, NotFound

SUFFIXES = (".jsonl", ".json", ".parquet")
"""File kinds the loaders read (besides a ``save_to_disk`` directory)."""
KINDS = "a .jsonl, .json or .parquet file, or a directory saved by datasets' save_to_disk"
"""What ``--dataset`` takes, in words (the errors say it)."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a dataset as a dict. ``NotFound`` for a missing path, ``InvalidRequest``
    for an unknown kind of file, a malformed file or no rows."""
    if path.is_dir():
        rows = read_saved(path)
    elif not path.is_file():
        raise NotFound(f"dataset not found: {KINDS} was expected", path=str(path))
    else:
        rows = read_file(path)
    if not rows:
        raise InvalidRequest("dataset has no rows", path=str(path))
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InvalidRequest("every row must be an object", path=str(path), row=i)
    return rows


def read_file(path: Path) -> list[Any]:
    """The rows of a ``.jsonl``, ``.json`` or ``.parquet`` file."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InvalidRequest(f"dataset must be {KINDS}", path=str(path))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows: list[Any] = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise InvalidRequest(
                "not a readable parquet file", path=str(path), error=str(exc)
            ) from None
        return rows
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest("not a JSON file", path=str(path), error=str(exc)) from None
        if not isinstance(data, list):
            raise InvalidRequest("a .json dataset must hold a list of rows", path=str(path))
        return data
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
    return rows


def read_saved(path: Path) -> list[Any]:
    """The rows of a directory ``datasets.Dataset.save_to_disk`` wrote; of a ``DatasetDict``'s,
    its ``train`` split (or its only split)."""
    try:
        import datasets
    except ImportError:  # a dependency of the project: only a broken install lacks it
        raise InvalidRequest(
            "reading a save_to_disk directory needs the datasets package", path=str(path)
        ) from None
    datasets.disable_progress_bars()
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a directory it cannot read
        raise InvalidRequest(
            f"not a datasets save_to_disk directory: dataset must be {KINDS}",
            path=str(path),
            error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        ) from None
    if isinstance(saved, datasets.DatasetDict):
        splits = list(saved)
        if "train" in saved:
            saved = saved["train"]
        elif len(splits) == 1:
            saved = saved[splits[0]]
        else:
            raise InvalidRequest(
                "a DatasetDict without a train split: name one split's directory",
                path=str(path),
                splits=splits,
            )
    rows: list[Any] = saved.to_list()
    return rows


def column_names(rows: list[dict[str, Any]]) -> list[str]:
    """Every column any row has, in the order they first appear."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def require_columns(rows: list[dict[str, Any]], columns: Sequence[str], path: Path) -> None:
    """``InvalidRequest`` naming the missing columns (and the first row missing one) and the
    columns the dataset has."""
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        if missing:
            raise InvalidRequest(
                f"dataset lacks column(s) {', '.join(missing)}",
                path=str(path),
                row=i,
                missing=missing,
                required=list(columns),
                present=column_names(rows),
            )
