"""Auto-sharding: Alpa's intra-operator pass over one graph on one device mesh."""

from graphpar.passes.autoshard.factors import register_sharding_rules
from graphpar.passes.autoshard.pass_ import AutoShard, shard_graph

__all__ = ["AutoShard", "shard_graph"]

register_sharding_rules()  # from here on each op carries its rule (OpDef.sharding_rule)
