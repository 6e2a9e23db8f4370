"""Files other processes read while they are written: each lands whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o644, sync: bool = False) -> None:
    """Write `text` beside `path` and rename it into place, so a reader polling for `path` sees the whole
    file or none (a reader that saw it appear and read it at once could otherwise find it empty). `mode` is
    the new file's permissions (0o600 for a key); `sync` makes it durable before the rename."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(partial, path)
