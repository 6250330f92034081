"""Optimizers and their learning-rate and weight-decay schedules."""
