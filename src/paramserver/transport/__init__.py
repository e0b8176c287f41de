"""How bytes move between nodes: the frame codec, gRPC server and client, and an in-process twin."""
