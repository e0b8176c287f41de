"""A shard's embedding tables: the table store, the Table protocol (table.py), the in-memory table and its
hash index, row admission and snapshots, the row-wise optimizers and the operator's limits. tiered/ holds
tables bigger than memory (the other kind of Table).

Nothing here imports torch or gRPC; the shard core (server/) holds the tables through TableStore.
"""
