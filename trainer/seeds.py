"""Each episode's sampling seed, a pure function of the job's seed, the step and the episode's index, so two
runs of one job file sample the same tokens (trainer/README.md, "Reproducible runs").

    episode_seed(job_seed, step, index, split="train")
        = the first 53 bits of SHA-256("tandem.sampling-seed.v1" NUL split NUL job_seed NUL step NUL index),
          read as a big-endian integer (the numbers written in decimal ASCII)

`step` is the number of the step the batch trains (1 for the first), or for an eval the step it follows;
`index` is the episode's place in its batch (prompt x group_size + member), or in the eval split. The split
keeps the training and evaluation episodes of one step apart. The result is below 2^53, so a Task App in
any language reads it exactly from the JSON body (a double holds every integer up to 2^53), and an app
that adds a call count to it (the SDK's `Policy` does, per turn) stays far from 2^64.
"""

from __future__ import annotations

import hashlib

DOMAIN = b"tandem.sampling-seed.v1"
SEED_BITS = 53


def episode_seed(job_seed: int, step: int, index: int, split: str = "train") -> int:
    """The sampling seed of episode `index` of `split` at `step` in a job seeded with `job_seed`."""
    if min(job_seed, step, index) < 0:
        raise ValueError("job_seed, step and index must be non-negative")
    message = b"\0".join([DOMAIN, split.encode(), b"%d" % job_seed, b"%d" % step, b"%d" % index])
    digest = hashlib.sha256(message).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
