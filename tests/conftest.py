"""Shared fixtures. PostgreSQL and Slurm tests start a real server (a real one-node or two-node Slurm cluster,
tests/support/slurm.py) once per session; in CI (CI=true) a missing one is an error, never a skip, so the
scale-out store and the Slurm backend cannot silently go untested."""

from __future__ import annotations

import os

# Tests start worker processes (fork, then exec) while in-process gRPC servers and clients run; gRPC's fork
# handlers are for children that go on using gRPC without exec, and a child caught while they are skipped can
# abort before its exec. None of these children uses gRPC before exec (the trainer sets the same).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import postgres
from tests.support.slurm import slurm_cluster, slurm_two_nodes

# Session fixtures registered here once: a module importing them itself would start its own cluster.
__all__ = ["slurm_cluster", "slurm_two_nodes"]


def _gpu_present() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def trusted_organizations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Meshes started by tests run tasks as the mesh's own account serving every organization (`run_as =
    mesh`, set explicitly), so a task may write where its test reads, in the test's own temporary folder. The
    default (`auto`: per-organization users in bubblewrap where the scheduler is root) is what
    tests/security/ and the demo's test run, by removing these two settings."""
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__RUN_AS", "mesh")
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__RUN_AS", "mesh")


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    if not postgres.available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed; .ci/run installs it")
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql)")
    with postgres.postgres_server() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_admin_url: str, request: pytest.FixtureRequest) -> str:
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:50]
    return postgres.create_database(postgres_admin_url, name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on both stores: an SQLite file and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url
