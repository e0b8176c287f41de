"""Launch surfaces: the `paramserver` command, the local cluster, and single nodes."""
