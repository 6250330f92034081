"""Parallelism: the device mesh, the logical-axis table, multi-host start-up and XLA flags."""
