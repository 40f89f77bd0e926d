"""docs/security.md's roles × subjects table is the permissions the server enforces
(``common/auth.py: grant``), and names every role."""

from __future__ import annotations

from pathlib import Path

from common.auth import ROLES, markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def test_the_roles_table_is_the_enforced_permissions() -> None:
    text = DOC.read_text()
    begin = text.index("<!-- roles:begin")
    start = text.index("\n", begin) + 1
    end = text.index("<!-- roles:end -->")
    assert text[start:end] == markdown_table(), (
        "docs/security.md's roles table differs from common/auth.py: regenerate it with "
        "python -c 'from common.auth import markdown_table; print(markdown_table())'"
    )
    for role in ROLES:
        assert f"| `{role}` |" in text
