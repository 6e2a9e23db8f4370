"""Job backends behind one interface (`base.Backend`): local processes, Slurm, Kubernetes."""
