"""Node assembly: a PS node, the coordinator's host, an in-process cluster; each built from the layers below."""
