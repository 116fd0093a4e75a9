"""What a run reports about itself: metrics, trackers, the curve, where its time went, its FLOPs.

- metrics.py: `MetricsLogger`: one console line and one JSON line (OUT/metrics.jsonl) per log step, the progress
  bar, the trackers; `read_metrics`.
- trackers.py: wandb, tensorboard and trackio, each used only when named in `log.trackers`.
- plot.py: the training curve (OUT/training_curve.png) drawn from metrics.jsonl, what it shows also in its metadata.
- timer.py: `Timer`, the one timer: named phases of a run (OUT/wall_time.json), laps between log lines, marks
  inside a step.
- flops.py: the cost model of a training step and the peak rate of the GPU it runs on: MFU.
"""
