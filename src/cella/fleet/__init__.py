"""A fleet of cella node daemons on a Ray cluster, behind one gateway.

Only `cluster`, `node_actor`, `gateway` and `evals` import Ray (the `cella[ray]` extra); the
single-host daemon imports nothing from here.
"""
