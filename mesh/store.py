"""Storage for the services that keep state: SQLite (WAL) embedded by default, PostgreSQL to scale out.

One small async interface over both, chosen by URL (`sqlite:///path.db`, `postgresql://...`). SQL is
written once with `?` placeholders and the portable subset of both dialects; where they differ a
migration gives one statement per dialect. Migrations are numbered per service, recorded in
`tandem_migrations`, applied in order inside one transaction each, and serialised across replicas
(PostgreSQL advisory lock; SQLite's write lock), so a fleet of replicas can start at once.
"""

from __future__ import annotations

import abc
import asyncio
import sqlite3
import time
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiosqlite

Dialect = Literal["sqlite", "postgres"]
Row = dict[str, Any]
Params = Sequence[Any]


class StoreError(Exception):
    """A storage failure the caller cannot fix by changing its request."""


class IntegrityError(StoreError):
    """A uniqueness or foreign-key constraint refused the write."""


@dataclass(frozen=True)
class Migration:
    """One schema step. `sql` is shared; `dialect_sql` overrides it per dialect. Statements split on ';'."""

    version: int
    name: str
    sql: str = ""
    dialect_sql: Mapping[Dialect, str] | None = None

    @classmethod
    def portable(cls, version: int, name: str, template: str) -> Migration:
        """One statement text for both dialects, with `{blob}`, `{bigint}` and `{serial}` (an auto-numbered
        primary key column type) filled in per dialect."""
        types: dict[Dialect, dict[str, str]] = {
            "sqlite": {"blob": "BLOB", "bigint": "INTEGER", "serial": "INTEGER"},
            "postgres": {"blob": "BYTEA", "bigint": "BIGINT", "serial": "BIGSERIAL"},
        }
        return cls(version, name, dialect_sql={d: template.format(**t) for d, t in types.items()})

    def for_dialect(self, dialect: Dialect) -> list[str]:
        text = (self.dialect_sql or {}).get(dialect, self.sql)
        return [s.strip() for s in text.split(";") if s.strip()]


class Executor(abc.ABC):
    """Run statements; a transaction and the database itself both offer this."""

    dialect: Dialect

    @abc.abstractmethod
    async def execute(self, sql: str, params: Params = ()) -> int: ...

    @abc.abstractmethod
    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]: ...

    async def fetchone(self, sql: str, params: Params = ()) -> Row | None:
        rows = await self.fetchall(sql, params)
        return rows[0] if rows else None

    async def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        for params in rows:
            await self.execute(sql, params)


class Database(Executor):
    """A connection to one store. Statements outside `transaction()` autocommit."""

    url: str

    @abc.abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Executor]:
        """`async with db.transaction() as tx:` commits on success, rolls back on error."""
        ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def migrate(self, service: str, migrations: Sequence[Migration]) -> list[int]:
        """Apply the service's pending migrations in version order; returns the versions applied."""
        versions = [m.version for m in migrations]
        if versions != sorted(set(versions)):
            raise StoreError(f"{service}: migration versions must be unique and increasing: {versions}")
        applied: list[int] = []
        async with self.transaction() as tx:
            await self._lock_migrations(tx)
            await tx.execute(
                "CREATE TABLE IF NOT EXISTS tandem_migrations ("
                " service TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL,"
                " applied_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (service, version))"
            )
            done = {
                r["version"]
                for r in await tx.fetchall(
                    "SELECT version FROM tandem_migrations WHERE service = ?", (service,)
                )
            }
            known = set(versions)
            if unknown := sorted(done - known):
                raise StoreError(f"{service}: database has migrations this code does not know: {unknown}")
            for migration in migrations:
                if migration.version in done:
                    continue
                for statement in migration.for_dialect(self.dialect):
                    await tx.execute(statement)
                await tx.execute(
                    "INSERT INTO tandem_migrations (service, version, name, applied_at) VALUES (?, ?, ?, ?)",
                    (service, migration.version, migration.name, time.time()),
                )
                applied.append(migration.version)
        return applied

    async def _lock_migrations(self, tx: Executor) -> None:
        """Hold off other replicas' migrations until this transaction ends (SQLite: BEGIN IMMEDIATE did)."""
        return None


def _sqlite_path(url: str) -> str:
    path = url.removeprefix("sqlite:///")
    return path if path == ":memory:" else str(Path(path))


class _SqliteTx(Executor):
    dialect: Dialect = "sqlite"

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Params = ()) -> int:
        try:
            cursor = await self._conn.execute(sql, tuple(params))
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from exc
        return cursor.rowcount

    async def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        try:
            await self._conn.executemany(sql, [tuple(r) for r in rows])
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from exc

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        # One call on the connection's thread runs, fetches and closes the statement, so a caller cancelled
        # mid-read cannot leave a statement open that pins an old snapshot for every later read.
        rows = await self._conn.execute_fetchall(sql, tuple(params))
        return [dict(r) for r in rows]


async def _enable_wal(conn: aiosqlite.Connection) -> None:
    # Switching the journal mode needs a moment of exclusive access and does not wait on the busy handler,
    # so replicas opening one file together retry briefly.
    for _ in range(200):
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            await asyncio.sleep(0.05)
    raise StoreError("SQLite file stayed locked while enabling WAL")


class SqliteDatabase(Database):
    """One writer connection (serialised by a lock) and one reader connection; WAL lets them overlap."""

    dialect: Dialect = "sqlite"

    def __init__(self, url: str, writer: aiosqlite.Connection, reader: aiosqlite.Connection) -> None:
        self.url = url
        self._writer = writer
        self._reader = reader
        self._write_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str, synchronous: str = "FULL") -> SqliteDatabase:
        path = _sqlite_path(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        conns = []
        for _ in range(2):
            conn = await aiosqlite.connect(path, isolation_level=None, timeout=30.0)
            conn.row_factory = sqlite3.Row
            await conn.execute("PRAGMA busy_timeout=30000")
            await _enable_wal(conn)
            await conn.execute(f"PRAGMA synchronous={synchronous}")
            await conn.execute("PRAGMA foreign_keys=ON")
            conns.append(conn)
        return cls(url, conns[0], conns[1])

    async def execute(self, sql: str, params: Params = ()) -> int:
        async with self._write_lock:
            return await _SqliteTx(self._writer).execute(sql, params)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return await _SqliteTx(self._reader).fetchall(sql, params)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self._write_lock:
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._writer)
            except BaseException:
                await self._writer.execute("ROLLBACK")
                raise
            await self._writer.execute("COMMIT")

    async def close(self) -> None:
        await self._writer.close()
        await self._reader.close()


def _pg_sql(sql: str) -> str:
    # Statements are ours and never contain a literal '?' or '%'; translate placeholders only.
    return sql.replace("%", "%%").replace("?", "%s")


class _PostgresTx(Executor):
    dialect: Dialect = "postgres"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Params = ()) -> int:
        import psycopg  # noqa: PLC0415

        try:
            cursor = await self._conn.execute(_pg_sql(sql), tuple(params))
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from exc
        return int(cursor.rowcount)

    async def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        import psycopg  # noqa: PLC0415

        try:
            async with self._conn.cursor() as cursor:
                await cursor.executemany(_pg_sql(sql), [tuple(r) for r in rows])
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from exc

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        cursor = await self._conn.execute(_pg_sql(sql), tuple(params))
        rows: list[Row] = await cursor.fetchall()
        return rows


class PostgresDatabase(Database):
    """A psycopg connection pool; each transaction takes one connection for its duration."""

    dialect: Dialect = "postgres"

    def __init__(self, url: str, pool: Any) -> None:
        self.url = url
        self.pool = pool

    @classmethod
    async def open(cls, url: str, min_size: int = 1, max_size: int = 10) -> PostgresDatabase:
        from psycopg.rows import dict_row  # noqa: PLC0415
        from psycopg_pool import AsyncConnectionPool  # noqa: PLC0415

        pool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={"row_factory": dict_row, "autocommit": True},
        )
        await pool.open(wait=True, timeout=30.0)
        return cls(url, pool)

    async def execute(self, sql: str, params: Params = ()) -> int:
        async with self.pool.connection() as conn:
            return await _PostgresTx(conn).execute(sql, params)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        async with self.pool.connection() as conn:
            return await _PostgresTx(conn).fetchall(sql, params)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self.pool.connection() as conn, conn.transaction():
            yield _PostgresTx(conn)

    async def _lock_migrations(self, tx: Executor) -> None:
        await tx.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(b"tandem:migrations"),))

    async def close(self) -> None:
        await self.pool.close()


async def open_database(url: str, service: str = "", migrations: Sequence[Migration] = ()) -> Database:
    """Connect by URL and bring the service's schema up to date."""
    db: Database
    if url.startswith("sqlite:///"):
        db = await SqliteDatabase.open(url)
    elif url.startswith(("postgresql://", "postgres://")):
        db = await PostgresDatabase.open(url)
    else:
        raise StoreError("store URL must start with sqlite:/// or postgresql://")
    if migrations:
        try:
            await db.migrate(service, migrations)
        except BaseException:
            await db.close()
            raise
    return db
