"""Scheduler: job groups, priorities, GPU placement and recovery over local processes, Slurm and
Kubernetes."""
