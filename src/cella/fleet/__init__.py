"""A fleet of cella node daemons on a Ray cluster, behind one gateway.

`cluster` and `node_actor` import Ray (the `cella[ray]` extra), and with them `membership`
(so the gateway) and `evals`; the single-host daemon imports nothing from here.
"""
