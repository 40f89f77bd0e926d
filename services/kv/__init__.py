"""The KV arena: each engine's paged KV block pool in shared memory, owned by this service
so that it outlives any rollout worker. ``arena`` holds the memory, ``service`` serves
``kv.get``/``kv.flush``, ``client`` maps an arena in a worker."""
