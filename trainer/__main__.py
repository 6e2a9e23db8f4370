"""`python -m trainer --config job.toml`: run an online-RL job on this machine (see trainer/launch.py)."""

import os
import sys
from pathlib import Path

# The launcher starts workers and the Task App as child processes while gRPC threads run; gRPC's fork
# handlers are for children that go on using gRPC without exec, which none of these do.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from mesh.observability import configure_tracing
from trainer.launch import main

# The trainer's spans (each step's rollouts and the calls they make) go to TANDEM_OTLP_ENDPOINT, else to the
# file in TANDEM_TRACE_FILE, whether the job runs its own mesh or a scheduler's. With neither, the embedded
# mesh sets tracing up when it starts (its state folder's traces.jsonl).
_endpoint = os.environ.get("TANDEM_OTLP_ENDPOINT", "")
_trace_file = os.environ.get("TANDEM_TRACE_FILE", "")
if _endpoint or _trace_file:
    configure_tracing("tandem-trainer", _endpoint, Path(_trace_file or "traces.jsonl").absolute())

sys.exit(main())
