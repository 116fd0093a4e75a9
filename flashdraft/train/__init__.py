"""Training a DFlash drafter against a frozen target: the loop and its parts, in the order a run meets them.

- loop.py: `train` (a whole run, top to bottom) and `train_step` (one optimizer step).
- setup.py: what a run holds before its first step (a frozen `Setup`): the device, target, tokenizer, drafter and
  data loader.
- dataloader.py: the stateful data loader: data order, collation, anchors and blocks, static-shape padding, and
  its place (saved in every checkpoint).
- forward.py: one micro-batch through the target, the drafter and the loss (what a step and an evaluation share).
- blocks.py, masks.py: the drafter's packed blocks and who sees what; loss/: the objective.
- evaluation.py: the held-out set and the measured τ, scored at step 0, every log.eval_every and at the end.
- optim.py: AdamW and the schedule; compile.py: whether the drafter's layers are compiled.
- resume.py: where `--resume` starts; checkpoint/: the resumable checkpoints (package: manager, save, load).
- report.py: the metrics row of a log line, the time to the first step, the run's result.

Beside it: flashdraft.distributed (many processes), flashdraft.telemetry (metrics, trackers, the curve, the
timer, FLOPs), flashdraft.benchmarks (`flashdraft bench train-step`).
"""
