"""The worker's side of the wire: where each variable lives, and the client that talks to all shards.

Torch-free: arrays are numpy; the torch integration lives in paramserver.worker.
"""
