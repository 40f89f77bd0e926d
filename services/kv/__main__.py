"""Belayer KV arena: allocates one zero-filled paged KV block pool per engine in shared memory
(/dev/shm/belayer-<run-id>-kv-<engine>), shaped from the model's config.json; serves
belayer.kv.get and belayer.kv.flush. The arenas outlive any rollout worker; SIGTERM removes
them."""

from common.service import exit_process, main
from services.kv.config import KvArenaConfig
from services.kv.service import run

if __name__ == "__main__":
    exit_process(
        main(KvArenaConfig, run, name="kv", prog="python -m services.kv", description=__doc__)
    )
