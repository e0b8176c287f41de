"""The parameter-server side: shards, their variables and optimizers, the shard service and node.

Nothing in this package imports torch, so a PS process stays small.
"""
