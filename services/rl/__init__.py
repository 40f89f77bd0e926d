"""The RL loop as a library: what ``belayer run`` and ``belayer bench train`` drive, and what a
Python API will be built on. Not a bus service: it runs in its caller's process and reaches
the node's services only through their clients.

- ``options``: a run's options, state (``run.json``), tasks and injections, checked before
  anything starts;
- ``loop``: ``run_step`` (one step: rollout → reward → train → push weights → eval) and
  ``train_loop`` (the steps of a run, each recorded);
- ``records``: a step's ``metrics.jsonl`` line and the run's totals;
- ``report``: what a run writes under its directory (metrics, TensorBoard, report, plots);
- ``held_out``: the greedy held-out evaluation; ``counters``: the run's counters;
- ``node``: the node a run uses (found, or started and stopped as plain functions);
- ``warm`` and ``demonstrations``: the warm-started tiny models.
"""
