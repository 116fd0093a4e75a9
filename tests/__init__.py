# The bundled configuration trains a new DSpark drafter from scratch (the first run a user sees). Most tests train the
# drafter the package ships instead, fine-tuned at its own learning rate: its acceptance is known to be well above 1,
# so a test that decodes with it can tell a working drafter from a broken one.
SHIPPED_DRAFTER = ["drafter.family=dflash", "drafter.init_from=bundled", "optim.lr=3e-4"]
