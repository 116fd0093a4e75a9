"""The DFlash training loss (fused.py), what it optimises (objective.py), what a step measures besides it
(stats.py), and a plain reference.

loss, stats = dflash_loss(hidden, lm_head_weight, batch.labels, batch.weights, block_size=bs,
                          objective=Objective.from_recipe(cfg.recipe))
stats.tau()          # simulated τ from per-position accuracy
"""

from flashdraft.train.loss.fused import dflash_loss
from flashdraft.train.loss.objective import Objective
from flashdraft.train.loss.stats import LossStats, expected_accepted, simulated_tau

__all__ = ["LossStats", "Objective", "dflash_loss", "expected_accepted", "simulated_tau"]
