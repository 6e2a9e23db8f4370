"""Online-RL job files and GPU placement, shared by the gateway, the scheduler and the trainer.

`tandem_jobs.config` reads a job file (the contract's `TrainerConfig` as TOML) and names each bad field;
`tandem_jobs.placement` is the pure planner that splits a node's GPUs between inference and training and
checks that they hold what it gives them. Neither imports torch or grpc: the services validate and place a
job without the ML stack, and `trainer/` keeps only what runs inside a job.
"""
