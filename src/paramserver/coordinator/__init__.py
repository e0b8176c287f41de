"""The coordinator (chief service): membership with heartbeats, the global step, and barriers.

Hosted by the chief, or by worker 0 when the cluster has no chief, on that node's cluster address.
"""
