"""Group commit of transaction programs (`Database.run`): concurrent callers' programs share a transaction
on SQLite, yet each is answered only after its own writes are committed and a failing program fails only its
own caller. The same tests hold on PostgreSQL, where each program has a transaction of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from mesh.store import Execute, Fetch, IntegrityError, Migration, Program, Row, open_database
from tests.support.processes import ROOT

MIGRATIONS = [Migration(1, "items", "CREATE TABLE items (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")]


class Refused(Exception):
    """A program's own decision to fail after it wrote something."""


def _insert(item: str, then: str = "") -> Program[str]:
    yield Execute("INSERT INTO items (id, n) VALUES (?, ?)", (item, 1))
    if then == "duplicate":
        yield Execute("INSERT INTO items (id, n) VALUES (?, ?)", ("taken", 1))
    if then == "raise":
        raise Refused(item)
    return item


_READ_COUNTER = {
    "sqlite": "SELECT n FROM items WHERE id = ?",  # SQLite's write transactions are serial already
    "postgres": "SELECT n FROM items WHERE id = ? FOR UPDATE",
}


def _bump(read: str) -> Program[int]:
    rows: list[Row] = yield Fetch(read, ("counter",))
    yield Execute("UPDATE items SET n = ? WHERE id = ?", (int(rows[0]["n"]) + 1, "counter"))
    return int(rows[0]["n"]) + 1


async def test_concurrent_programs_all_commit_and_a_failing_one_fails_only_its_caller(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("taken", 0))
        plans = {f"ok-{i}": "" for i in range(30)}
        plans |= {f"dup-{i}": "duplicate" for i in range(5)}
        plans |= {f"raise-{i}": "raise" for i in range(5)}
        results = await asyncio.gather(
            *(db.run(_insert(i, then)) for i, then in plans.items()), return_exceptions=True
        )
        outcome = dict(zip(plans, results, strict=True))
        assert all(outcome[i] == i for i in plans if i.startswith("ok-"))
        assert all(isinstance(outcome[i], IntegrityError) for i in plans if i.startswith("dup-"))
        assert all(
            isinstance(outcome[i], Refused) and str(outcome[i]) == i for i in plans if i.startswith("raise-")
        )
    finally:
        await db.close()
    reopened = await open_database(store_url, "svc", MIGRATIONS)  # what was answered is on disk
    try:
        rows = await reopened.fetchall("SELECT id FROM items ORDER BY id")
        assert sorted(str(r["id"]) for r in rows) == sorted(
            ["taken", *(i for i in plans if i.startswith("ok-"))]
        )
    finally:
        await reopened.close()


async def test_programs_of_one_group_see_each_others_writes_in_order(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("counter", 0))
        seen = await asyncio.gather(*(db.run(_bump(_READ_COUNTER[db.dialect])) for _ in range(50)))
        assert sorted(seen) == list(range(1, 51))
        assert await db.fetchone("SELECT n FROM items WHERE id = ?", ("counter",)) == {"n": 50}
    finally:
        await db.close()


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from mesh.store import Execute, Migration, open_database

    def insert(item):
        yield Execute("INSERT INTO items (id, n) VALUES (?, ?)", (item, 1))
        return item

    async def main(url):
        table = "CREATE TABLE items (id TEXT PRIMARY KEY, n INTEGER NOT NULL)"
        db = await open_database(url, "svc", [Migration(1, "items", table)])
        print("ready", flush=True)
        n = 0
        async def writer(w):
            nonlocal n
            while True:
                n += 1
                item = await db.run(insert(f"{w}-{n}"))
                print(item, flush=True)
        await asyncio.gather(*(writer(w) for w in range(8)))

    asyncio.run(main(sys.argv[1]))
    """
)


def test_every_answered_program_survives_sigkill(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen" / "python")])}
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, url], stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    assert child.stdout is not None
    acknowledged: list[str] = []
    try:
        assert child.stdout.readline().strip() == "ready"
        while len(acknowledged) < 300:
            line = child.stdout.readline().strip()
            assert line, "the writer stopped before it was killed"
            acknowledged.append(line)
        child.send_signal(signal.SIGKILL)
        acknowledged.extend(line.strip() for line in child.stdout if line.strip())
    finally:
        child.kill()
        child.wait()
    assert set(acknowledged) <= asyncio.run(_stored_ids(url))


async def _stored_ids(url: str) -> set[str]:
    db = await open_database(url, "svc", MIGRATIONS)
    try:
        return {str(r["id"]) for r in await db.fetchall("SELECT id FROM items")}
    finally:
        await db.close()
