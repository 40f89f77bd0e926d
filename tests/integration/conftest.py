"""Fixtures shared by the integration tests (the bus fixtures live in ``tests/conftest.py``, the
node fixture in ``tests/node_fixtures.py``)."""

from tests.integration.shm_helpers import model_dir, run_id
from tests.integration.trainer_helpers import trainer_bus
from tests.node_fixtures import node

__all__ = ["model_dir", "node", "run_id", "trainer_bus"]
