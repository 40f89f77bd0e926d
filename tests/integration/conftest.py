"""Fixtures shared by the integration tests (the bus fixtures live in ``tests/conftest.py``)."""

from tests.integration.shm_helpers import model_dir, run_id

__all__ = ["model_dir", "run_id"]
