"""The one node fixture of the integration and chaos tests (imported by their ``conftest.py``).

A test module declares how its node is started with a module-level ``NODE_ARGS`` (extra
``belayer up --detach`` arguments, e.g. ``("--engines", "2")``); every test of the module shares
that node, which is stopped with ``belayer down`` and checked for leftovers after the last one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported when a test uses the fixture, not when a conftest loads
    from tests.integration.node_helpers import Node


@pytest.fixture(scope="module")
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    """A real node (``belayer up --detach`` with the module's ``NODE_ARGS``) for the module."""
    from tests.integration.node_helpers import start_node, stop_node

    args = tuple(getattr(request.module, "NODE_ARGS", ()))
    if "--environment" in args:
        from tests.integration.env_helpers import require_docker

        require_docker()
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    n = start_node(tmp_path_factory.mktemp(name), *args)
    try:
        yield n
    finally:
        stop_node(n)
