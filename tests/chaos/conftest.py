"""Fixtures of the chaos tests: the shared node fixture (``tests/node_fixtures.py``; each module
sets ``NODE_ARGS``)."""

from tests.node_fixtures import node

__all__ = ["node"]
