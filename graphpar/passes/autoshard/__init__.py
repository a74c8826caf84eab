"""Auto-sharding: Alpa's intra-operator pass over one graph on one device mesh."""

from graphpar.passes.autoshard.pass_ import AutoShard, shard_graph

__all__ = ["AutoShard", "shard_graph"]
