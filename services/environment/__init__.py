"""Environment service: Docker sandboxes with prefix-consistent full_checkpoint/full_restore."""
