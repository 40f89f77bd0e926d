"""The weight store: versioned model weights in shared memory that other processes map.

``core`` packs a state dict into one flat buffer (pure), ``shm`` creates and maps the memory,
``service`` serves ``weights.get``/``weights.push`` on the bus, ``client`` is what readers
(rollout workers, shadows) and writers (the trainer) call.
"""
