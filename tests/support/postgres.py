"""A real PostgreSQL server for the test session, from Debian's packages (`postgresql`).

initdb into a temporary folder, start on a free loopback port, hand out one fresh database per test.
PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user the package creates.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg


def _bin(name: str) -> str | None:
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else shutil.which(name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def available() -> bool:
    return _bin("initdb") is not None and _bin("pg_ctl") is not None


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the URL of the maintenance database of a freshly initialised server."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("PostgreSQL is not installed (apt-get install -y postgresql)")
    root = Path(tempfile.mkdtemp(prefix="tandem-pg-"))
    data = root / "data"
    port = free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    try:
        run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        options = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=200"
        run(pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "server.log"), "-w", "-t", "60", "start")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)


def create_database(admin_url: str, name: str) -> str:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + f"/{name}"
