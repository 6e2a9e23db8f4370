"""The storage layer on both stores: migrations, transactions, constraint errors, concurrent starts."""

from __future__ import annotations

import asyncio

import pytest

from mesh.store import (
    Execute,
    ExecuteMany,
    Fetch,
    IntegrityError,
    Migration,
    Program,
    Row,
    StoreError,
    open_database,
)

MIGRATIONS = [
    Migration(1, "items", "CREATE TABLE items (id TEXT PRIMARY KEY, n INTEGER NOT NULL)"),
    Migration(
        2,
        "counter",
        dialect_sql={
            "sqlite": "CREATE TABLE counter (id INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT)",
            "postgres": "CREATE TABLE counter (id BIGSERIAL PRIMARY KEY, v TEXT)",
        },
    ),
]


async def test_migrations_apply_once_in_order(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        rows = await db.fetchall(
            "SELECT version, name FROM tandem_migrations WHERE service = ? ORDER BY version", ("svc",)
        )
        assert [(r["version"], r["name"]) for r in rows] == [(1, "items"), (2, "counter")]
        assert await db.migrate("svc", MIGRATIONS) == []
        extra = [*MIGRATIONS, Migration(3, "index", "CREATE INDEX items_n ON items (n)")]
        assert await db.migrate("svc", extra) == [3]
    finally:
        await db.close()


async def test_services_have_separate_migration_histories(store_url: str) -> None:
    db = await open_database(store_url, "one", MIGRATIONS[:1])
    try:
        other = [Migration(1, "other", "CREATE TABLE other_items (id TEXT PRIMARY KEY)")]
        assert await db.migrate("two", other) == [1]
    finally:
        await db.close()


async def test_database_ahead_of_code_is_refused(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    await db.close()
    with pytest.raises(StoreError, match="does not know"):
        await open_database(store_url, "svc", MIGRATIONS[:1])


async def test_migration_versions_must_increase(store_url: str) -> None:
    with pytest.raises(StoreError, match="unique and increasing"):
        await open_database(store_url, "svc", [MIGRATIONS[1], MIGRATIONS[0]])


async def test_failed_migration_leaves_nothing_half_applied(store_url: str) -> None:
    broken = [
        *MIGRATIONS,
        Migration(3, "broken", "CREATE TABLE t3 (x INTEGER); CREATE TABLE items (dup INTEGER)"),
    ]
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        with pytest.raises(Exception):  # noqa: B017 - each driver raises its own error type here
            await db.migrate("svc", broken)
        assert await db.fetchone("SELECT version FROM tandem_migrations WHERE version = 3") is None
        await db.execute("CREATE TABLE t3 (x INTEGER)")  # proves t3 was rolled back
    finally:
        await db.close()


async def test_transaction_commits_or_rolls_back(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 1))
            await tx.executemany("INSERT INTO items (id, n) VALUES (?, ?)", [("b", 2), ("c", 3)])
        with pytest.raises(RuntimeError):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("d", 4))
                raise RuntimeError("abort")
        rows = await db.fetchall("SELECT id, n FROM items ORDER BY id")
        assert rows == [{"id": "a", "n": 1}, {"id": "b", "n": 2}, {"id": "c", "n": 3}]
        assert await db.execute("UPDATE items SET n = n + 10 WHERE n >= ?", (2,)) == 2
    finally:
        await db.close()


def _insert_then(ids: list[str]) -> Program[int]:
    for item in ids:
        yield Execute("INSERT INTO items (id, n) VALUES (?, ?)", (item, 1))
    rows: list[Row] = yield Fetch("SELECT COUNT(*) AS n FROM items")
    yield ExecuteMany("UPDATE items SET n = ? WHERE id = ?", [(7, i) for i in ids])
    return int(rows[0]["n"])


async def test_a_transaction_program_commits_when_it_returns_and_only_then(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        assert await db.run(_insert_then(["a", "b"])) == 2
        with pytest.raises(IntegrityError):
            await db.run(_insert_then(["c", "a"]))  # "a" exists: the program ends, "c" is rolled back
        rows = await db.fetchall("SELECT id, n FROM items ORDER BY id")
        assert rows == [{"id": "a", "n": 7}, {"id": "b", "n": 7}]
    finally:
        await db.close()


def _count_then_items() -> Program[tuple[int, list[str]]]:
    counted: list[Row] = yield Fetch("SELECT COUNT(*) AS n FROM items")
    rows: list[Row] = yield Fetch("SELECT id FROM items ORDER BY id")
    return int(counted[0]["n"]), [str(r["id"]) for r in rows]


def _read_then_write() -> Program[None]:
    yield Fetch("SELECT COUNT(*) AS n FROM items")
    yield Execute("INSERT INTO items (id, n) VALUES (?, ?)", ("sneaky", 1))


async def test_a_read_program_reads_and_refuses_to_write(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.run(_insert_then(["a", "b"]))
        assert await db.read(_count_then_items()) == (2, ["a", "b"])
        with pytest.raises(StoreError):
            await db.read(_read_then_write())
        assert await db.read(_count_then_items()) == (2, ["a", "b"])
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("c", 1))  # the snapshot ended
        reads = await asyncio.gather(*(db.read(_count_then_items()) for _ in range(8)))
        assert reads == [(3, ["a", "b", "c"])] * 8
    finally:
        await db.close()


async def test_constraint_violation_is_an_integrity_error(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 1))
        with pytest.raises(IntegrityError):
            await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 2))
        with pytest.raises(IntegrityError):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("z", 1))
                await tx.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 3))
        assert await db.fetchone("SELECT id FROM items WHERE id = ?", ("z",)) is None
    finally:
        await db.close()


async def test_replicas_starting_together_migrate_once(store_url: str) -> None:
    dbs = await asyncio.gather(*(open_database(store_url, "svc", MIGRATIONS) for _ in range(4)))
    try:
        rows = await dbs[0].fetchall("SELECT version FROM tandem_migrations WHERE service = ?", ("svc",))
        assert sorted(r["version"] for r in rows) == [1, 2]
    finally:
        for db in dbs:
            await db.close()


async def test_concurrent_writers_are_serialised(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("k", 0))

        async def bump() -> None:
            async with db.transaction() as tx:
                if tx.dialect == "postgres":
                    row = await tx.fetchone("SELECT n FROM items WHERE id = ? FOR UPDATE", ("k",))
                else:
                    row = await tx.fetchone("SELECT n FROM items WHERE id = ?", ("k",))
                assert row is not None
                await tx.execute("UPDATE items SET n = ? WHERE id = ?", (row["n"] + 1, "k"))

        await asyncio.gather(*(bump() for _ in range(20)))
        assert await db.fetchone("SELECT n FROM items WHERE id = ?", ("k",)) == {"n": 20}
    finally:
        await db.close()


async def test_unknown_url_scheme_is_refused() -> None:
    with pytest.raises(StoreError, match="sqlite:///"):
        await open_database("mysql://x", "svc")


async def test_cancelled_reads_do_not_pin_an_old_snapshot(store_url: str) -> None:
    db = await open_database(store_url, "svc", MIGRATIONS)
    try:
        await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("seed", 0))
        for trial in range(20):
            readers = [asyncio.ensure_future(db.fetchall("SELECT * FROM items")) for _ in range(10)]
            await asyncio.sleep(0)
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await db.execute("INSERT INTO items (id, n) VALUES (?, ?)", (f"t{trial}", trial))
            assert await db.fetchone("SELECT n FROM items WHERE id = ?", (f"t{trial}",)) == {"n": trial}
    finally:
        await db.close()
