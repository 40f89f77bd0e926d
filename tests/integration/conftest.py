"""Fixtures shared by the integration tests (the bus fixtures live in ``tests/conftest.py``, the
node fixture in ``tests/node_fixtures.py``). A test names a fixture as a parameter; pytest finds
it here, so no test module imports a fixture (nor shadows the import with its parameter)."""

from tests.integration.env_helpers import env
from tests.integration.shm_helpers import model_dir, run_id
from tests.integration.trainer_helpers import trainer_bus
from tests.node_fixtures import node

__all__ = ["env", "model_dir", "node", "run_id", "trainer_bus"]
