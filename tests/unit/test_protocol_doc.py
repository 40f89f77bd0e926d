"""docs/protocol.md must not drift from the code: every tagged message of ``schemas/`` and every
subject function of ``common/subjects.py`` is mentioned in it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import msgspec

import schemas
from common import subjects

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def tagged_messages() -> dict[str, str]:
    """Class name → tag of every tagged ``msgspec.Struct`` defined in a ``schemas`` module."""
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(schemas.__path__):
        module = importlib.import_module(f"schemas.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if name.startswith("_") or not issubclass(cls, msgspec.Struct):
                continue
            if cls.__module__ != module.__name__:
                continue
            tag = cls.__struct_config__.tag
            if isinstance(tag, str):
                found[name] = tag
    return found


def subject_functions() -> list[str]:
    return [
        name
        for name, fn in inspect.getmembers(subjects, inspect.isfunction)
        if fn.__module__ == subjects.__name__ and not name.startswith("_")
    ]


def test_every_tagged_message_is_documented() -> None:
    doc = DOC.read_text()
    messages = tagged_messages()
    assert messages, "no tagged messages found in schemas/"
    missing = [f"{n} ({t})" for n, t in messages.items() if f"`{n}`" not in doc or t not in doc]
    assert not missing, f"docs/protocol.md does not mention: {missing}"


def test_every_subject_function_is_documented() -> None:
    doc = DOC.read_text()
    functions = subject_functions()
    assert "router_generate" in functions
    missing = [name for name in functions if f"`{name}`" not in doc]
    assert not missing, f"docs/protocol.md does not mention subject functions: {missing}"


def test_every_stream_and_bucket_is_documented() -> None:
    doc = DOC.read_text()
    names = [
        value
        for key, value in vars(subjects).items()
        if key.startswith(("STREAM_", "BUCKET_")) and isinstance(value, str)
    ]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/protocol.md does not mention: {missing}"
