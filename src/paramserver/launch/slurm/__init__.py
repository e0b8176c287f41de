"""Slurm: a task started by `srun` runs `paramserver node` with no TF_CONFIG. Its role, index and the
whole cluster come from the job step's environment (environment.py; host lists and task counts in
Slurm's compressed forms: hostlist.py)."""
