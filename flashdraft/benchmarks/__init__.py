"""The domain code of `flashdraft bench`: what it measures and how (the command's arguments are cli/bench.py's).

- train_step.py: `flashdraft bench train-step`, the trainer's own step (`train.loop.train_step`) timed phase by
  phase on a config's target and drafter over synthetic sequences.
"""
