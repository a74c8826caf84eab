"""Pipeline parallelism: slicing a training graph into stages on sub-meshes, and lowering it."""
