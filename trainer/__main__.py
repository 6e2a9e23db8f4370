"""`python -m trainer --config job.toml`: run an online-RL job on this machine (see trainer/launch.py)."""

import sys

from trainer.launch import main

sys.exit(main())
