"""The training wing: `graphpar train` runs the compiled step for many steps on data, alone
(one worker process per device) or under torchrun, with DCP checkpoints that resume on another
mesh and load into the plain module (docs/training.md)."""
