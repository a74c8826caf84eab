"""Cost model: cluster descriptions, units, and alpha-beta collective and resharding costs.

Modules (import them directly; this package re-exports nothing, so that
`graphpar.ir.mesh` can import `graphpar.cost.cluster` without an import cycle):

- `graphpar.units`: `parse_bytes("80GiB")`, `format_bytes`, bandwidth, time and FLOP/s strings.
- `graphpar.cost.cluster`: `Cluster`, the presets (`PRESETS`, `get_cluster`) and cluster files.
- `graphpar.cost.communication`: alpha-beta costs of collectives and `resharding_cost`.
"""
