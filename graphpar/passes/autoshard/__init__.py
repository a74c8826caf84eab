"""Auto-sharding: Alpa's intra-operator pass over one graph on one device mesh."""

from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import AutoShard
from graphpar.passes.autoshard.factors import register_sharding_rules

__all__ = ["AutoShard", "shard_graph"]

register_sharding_rules()  # from here on each op carries its rule (OpDef.sharding_rule)
