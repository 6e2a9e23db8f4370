"""`python -m trainer --config job.toml`: run an online-RL job on this machine (see trainer/launch.py)."""

import os
import sys

# The launcher starts workers and the Task App as child processes while gRPC threads run; gRPC's fork
# handlers are for children that go on using gRPC without exec, which none of these do.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from trainer.launch import main

sys.exit(main())
