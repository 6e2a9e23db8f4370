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
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

Dialect = Literal["sqlite", "postgres"]
Row = dict[str, Any]
Params = Sequence[Any]
T = TypeVar("T")


class StoreError(Exception):
    """A storage failure the caller cannot fix by changing its request."""


class IntegrityError(StoreError):
    """A uniqueness or foreign-key constraint refused the write."""


@dataclass(frozen=True)
class Migration:
    """One schema step. `sql` is shared; `dialect_sql` overrides it per dialect. Statements split on ';'.
    `program`, when given, runs after the statements in the same transaction: a data migration written as
    a transaction program (see `Program`), given the dialect."""

    version: int
    name: str
    sql: str = ""
    dialect_sql: Mapping[Dialect, str] | None = None
    program: Callable[[Dialect], Program[None]] | None = None

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


@dataclass(frozen=True)
class Fetch:
    """A statement whose rows the program receives."""

    sql: str
    params: Params = ()


@dataclass(frozen=True)
class Execute:
    """A statement whose affected row count the program receives."""

    sql: str
    params: Params = ()


@dataclass(frozen=True)
class ExecuteMany:
    """One statement over many parameter rows; the program receives None."""

    sql: str
    rows: Sequence[Params]


Statement = Fetch | Execute | ExecuteMany
Program = Generator[Statement, Any, T]
"""A transaction written once for both stores: a generator that yields statements, is sent each result, and
returns its result. `Database.run` commits it when it returns and rolls it back when it raises or one of
its statements fails (PostgreSQL accepts nothing more in a transaction after a failed statement, so the
program is not asked to carry on)."""


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

    async def run(self, program: Program[T]) -> T:
        """Run a transaction program in one transaction (on SQLite, one it may share with other callers'
        programs, each in a savepoint: see `SqliteDatabase`); returns once that transaction committed."""
        async with self.transaction() as tx:
            return await _drive(tx, program)

    async def read(self, program: Program[T]) -> T:
        """Run a program of reads (`Fetch` only) in one read transaction, so all its statements see one
        state of the store; it takes no write lock. SQLite runs it whole on the reader's thread: one
        hand-off between threads, not one per statement."""
        async with self.transaction() as tx:
            return await _drive(_ReadOnly(tx), program)

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
                if migration.program is not None:
                    await _drive(tx, migration.program(self.dialect))
                await tx.execute(
                    "INSERT INTO tandem_migrations (service, version, name, applied_at) VALUES (?, ?, ?, ?)",
                    (service, migration.version, migration.name, time.time()),
                )
                applied.append(migration.version)
        return applied

    async def _lock_migrations(self, tx: Executor) -> None:
        """Hold off other replicas' migrations until this transaction ends (SQLite: BEGIN IMMEDIATE did)."""
        return None


class _ReadOnly(Executor):
    """The reads of `tx`; a program given to `Database.read` that tries to write is a bug."""

    def __init__(self, tx: Executor) -> None:
        self.dialect = tx.dialect
        self._tx = tx

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return await self._tx.fetchall(sql, params)

    async def execute(self, sql: str, params: Params = ()) -> int:
        raise StoreError("a read program tried to write")


async def _drive(tx: Executor, program: Program[T]) -> T:
    """Run a transaction program's statements on `tx`, sending each result back, until it returns. A failed
    statement ends the program (it is closed, its `finally` blocks run) and the error comes out of here."""
    try:
        statement = next(program)
        while True:
            try:
                result = await _run_async(tx, statement)
            except BaseException:
                program.close()
                raise
            statement = program.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


async def run_on(tx: Executor, program: Program[T]) -> T:
    """Run a program's statements on `tx`, a transaction already open (`async with db.transaction() as
    tx`), so that one program of reads serves both inside a transaction and in `Database.read`."""
    return await _drive(tx, program)


async def _run_async(tx: Executor, statement: Statement) -> Any:
    if isinstance(statement, Fetch):
        return await tx.fetchall(statement.sql, statement.params)
    if isinstance(statement, ExecuteMany):
        return await tx.executemany(statement.sql, statement.rows)
    return await tx.execute(statement.sql, statement.params)


def _sqlite_path(url: str) -> str:
    path = url.removeprefix("sqlite:///")
    return path if path == ":memory:" else str(Path(path))


class _SqliteConnection:
    """A sqlite3 connection that lives on one thread of its own: every call runs there, in the order it was
    made, so the event loop never blocks on SQLite and a statement always finishes (and closes) on the
    thread even when the coroutine that asked for it was cancelled."""

    def __init__(self, conn: sqlite3.Connection, thread: ThreadPoolExecutor) -> None:
        self.raw = conn
        self._thread = thread

    @classmethod
    async def open(cls, path: str, synchronous: str) -> _SqliteConnection:
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-sqlite")

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, isolation_level=None, timeout=30.0, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=30000")
            _enable_wal(conn)
            conn.execute(f"PRAGMA synchronous={synchronous}")
            conn.execute("PRAGMA foreign_keys=ON")
            return conn

        try:
            conn = await asyncio.get_running_loop().run_in_executor(thread, connect)
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(conn, thread)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def close(self) -> None:
        await self.call(self.raw.close)
        self._thread.shutdown(wait=True)


def _sqlite_execute(conn: sqlite3.Connection, sql: str, params: Params) -> int:
    try:
        return conn.execute(sql, tuple(params)).rowcount
    except sqlite3.IntegrityError as exc:
        raise IntegrityError(str(exc)) from exc


def _sqlite_executemany(conn: sqlite3.Connection, sql: str, rows: Sequence[Params]) -> None:
    try:
        conn.executemany(sql, [tuple(r) for r in rows])
    except sqlite3.IntegrityError as exc:
        raise IntegrityError(str(exc)) from exc


def _sqlite_fetchall(conn: sqlite3.Connection, sql: str, params: Params) -> list[Row]:
    # Runs, fetches and closes the statement in one call, so no open statement pins an old snapshot.
    return [dict(r) for r in conn.execute(sql, tuple(params)).fetchall()]


class _SqliteThreadTx(Executor):
    """Statements run directly on the connection: for code already on the connection's thread. Its
    coroutines never suspend, so `_run_to_completion` can run them without an event loop."""

    dialect: Dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Params = ()) -> int:
        return _sqlite_execute(self._conn, sql, params)

    async def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        _sqlite_executemany(self._conn, sql, rows)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return _sqlite_fetchall(self._conn, sql, params)


def _run_to_completion(coroutine: Coroutine[Any, Any, T]) -> T:
    try:
        coroutine.send(None)
    except StopIteration as stop:
        value: T = stop.value
        return value
    coroutine.close()
    raise StoreError("a transaction program on SQLite's thread waited on something other than SQLite")


Outcome = tuple[bool, Any]
"""A program's end in a commit group: (True, its result) or (False, the exception it raised)."""


def _sqlite_run_group(conn: sqlite3.Connection, programs: Sequence[Program[Any]]) -> list[Outcome]:
    """Run several callers' programs in one transaction, each inside a savepoint, and commit once: one
    fsync for the group. A program that raises (or whose statement fails) is rolled back to its savepoint
    alone and its exception becomes its outcome; the others still commit. If the transaction itself cannot
    go on (SQLite rolled it back, or COMMIT failed) the error comes out of here and no program committed."""
    conn.execute("BEGIN IMMEDIATE")
    outcomes: list[Outcome] = []
    try:
        for program in programs:
            conn.execute("SAVEPOINT tandem_program")
            try:
                result = _run_to_completion(_drive(_SqliteThreadTx(conn), program))
            except Exception as exc:  # handed to the program's own caller
                conn.execute("ROLLBACK TO tandem_program")
                conn.execute("RELEASE tandem_program")
                outcomes.append((False, exc))
            else:
                conn.execute("RELEASE tandem_program")
                outcomes.append((True, result))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return outcomes


def _sqlite_read_program(conn: sqlite3.Connection, program: Program[T]) -> T:
    conn.execute("BEGIN")  # deferred: a read snapshot from the first statement on, no lock taken
    try:
        return _run_to_completion(_drive(_ReadOnly(_SqliteThreadTx(conn)), program))
    finally:
        conn.execute("COMMIT")  # nothing was written: this only ends the snapshot


class _SqliteTx(Executor):
    dialect: Dialect = "sqlite"

    def __init__(self, conn: _SqliteConnection) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self._conn.call(_sqlite_execute, self._conn.raw, sql, params)

    async def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        await self._conn.call(_sqlite_executemany, self._conn.raw, sql, rows)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return await self._conn.call(_sqlite_fetchall, self._conn.raw, sql, params)


def _enable_wal(conn: sqlite3.Connection) -> None:
    # Switching the journal mode needs a moment of exclusive access and does not wait on the busy handler,
    # so replicas opening one file together retry briefly.
    for _ in range(200):
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            time.sleep(0.05)
    raise StoreError("SQLite file stayed locked while enabling WAL")


class SqliteDatabase(Database):
    """One writer connection (serialised by a lock) and one reader connection; WAL lets them overlap.

    `run` commits in groups: the programs callers hand it while a commit is under way queue up, and the
    next commit runs them all in one transaction (a savepoint each) with one fsync. Each caller is answered
    only after the commit that holds its writes, so an answered `run` is as durable as a lone one; a program
    that fails fails only its own caller."""

    dialect: Dialect = "sqlite"
    max_group = 64

    def __init__(self, url: str, writer: _SqliteConnection, reader: _SqliteConnection) -> None:
        self.url = url
        self._writer = writer
        self._reader = reader
        self._write_lock = asyncio.Lock()
        self._queued: list[tuple[Program[Any], asyncio.Future[Any]]] = []
        self._committer: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, url: str, synchronous: str = "FULL") -> SqliteDatabase:
        path = _sqlite_path(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        writer = await _SqliteConnection.open(path, synchronous)
        try:
            reader = await _SqliteConnection.open(path, synchronous)
        except BaseException:
            await writer.close()
            raise
        return cls(url, writer, reader)

    async def execute(self, sql: str, params: Params = ()) -> int:
        async with self._write_lock:
            return await _SqliteTx(self._writer).execute(sql, params)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return await _SqliteTx(self._reader).fetchall(sql, params)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self._write_lock:
            tx = _SqliteTx(self._writer)
            await tx.execute("BEGIN IMMEDIATE")
            try:
                yield tx
            except BaseException:
                await tx.execute("ROLLBACK")
                raise
            await tx.execute("COMMIT")

    async def run(self, program: Program[T]) -> T:
        # Whole programs, Python between statements included, run in one call on the writer's thread: a
        # commit group costs one hand-off between threads and one fsync, not one per statement or caller.
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queued.append((program, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_queued())
        return await future

    async def _commit_queued(self) -> None:
        while self._queued:
            group = [(p, f) for p, f in self._queued[: self.max_group] if not f.cancelled()]
            del self._queued[: self.max_group]
            if not group:
                continue
            try:
                async with self._write_lock:
                    outcomes = await self._writer.call(
                        _sqlite_run_group, self._writer.raw, [p for p, _ in group]
                    )
            except BaseException as exc:
                for _, future in group:
                    if future.done():
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, future), (ok, value) in zip(group, outcomes, strict=True):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    async def read(self, program: Program[T]) -> T:
        return await self._reader.call(_sqlite_read_program, self._reader.raw, program)

    async def close(self) -> None:
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)
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

    async def read(self, program: Program[T]) -> T:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")  # one snapshot
            return await _drive(_ReadOnly(_PostgresTx(conn)), program)

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
