"""Pipeline parallelism: stage partition of training graphs and their MPMD lowering."""
