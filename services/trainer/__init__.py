"""The GRPO trainer: ``core`` (advantages, loss, batching: pure), ``update`` (one update and
its checkpoint on the model: pure), ``journal`` (checkpoint and plan files), ``service`` (the
bus: trajectories in, weights out), ``client`` (what others call)."""
