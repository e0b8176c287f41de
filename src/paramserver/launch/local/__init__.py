"""`paramserver run`: the local supervisor that starts every node of a run as a child process."""
