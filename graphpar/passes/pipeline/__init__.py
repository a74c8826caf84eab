"""Pipeline parallelism: slicing a training graph into stages on sub-meshes (clustering,
the stage DP), the stage partition of training graphs and their MPMD lowering."""
