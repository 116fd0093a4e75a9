"""Training: the loop, optimizer and schedule, resumable checkpoints (checkpoint.py), metrics and logging (metrics.py)."""
