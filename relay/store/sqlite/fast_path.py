"""The hot statements, compiled once and run on the database driver.

SQLAlchemy builds an execution context for every ``Connection.execute``: parameter
processing, result set-up, event dispatch: 30-40 µs a statement, more than SQLite takes to
run it on a local WAL file. The few statements every run executes (admit, the state
writes, the limit counts) go through :func:`write` and :func:`row` instead: on SQLite
each is compiled once per set of parameter names, then executed straight on the
``sqlite3`` connection inside the same transaction; on PostgreSQL they are executed the
ordinary way. The statements themselves stay SQLAlchemy Core, defined once in the store.
On both engines a parameter that names no column and no bound value is an error, where
SQLAlchemy would drop it silently from an UPDATE's execution parameters.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

Statement = sa.Insert | sa.Update | sa.Delete | sa.Select[*tuple[Any, ...]]
_Compiled = tuple[str, tuple[tuple[str, Any], ...]]
_cache: dict[tuple[int, str, tuple[str, ...]], _Compiled] = {}


def _compiled(conn: Connection, statement: Statement, names: tuple[str, ...]) -> _Compiled:
    key = (id(statement), conn.dialect.name, names)
    found = _cache.get(key)
    if found is not None:
        return found
    table = getattr(statement, "table", None)
    columns = [name for name in names if table is not None and name in table.c]
    compiled = statement.compile(dialect=conn.dialect, column_keys=columns)
    order: list[tuple[str, Any]] = []
    for name in compiled.positiontup or ():
        default = None
        if name not in names and table is not None and name in table.c:
            # A column the caller left out: its Python-side default, as SQLAlchemy would.
            column_default = table.c[name].default
            if column_default is not None:
                assert column_default.is_scalar, f"{name}: only constant defaults here"
                default = column_default.arg
        elif name not in names and name in compiled.binds:
            # A value written into the statement (the 0 of ``coalesce(sum(x), 0)``).
            default = compiled.binds[name].effective_value
        order.append((name, default))
    unused = set(names) - {name for name, _ in order}
    if unused:  # what SQLAlchemy calls unconsumed: a misspelt column must not vanish
        raise sa.exc.CompileError(f"no such column or parameter: {sorted(unused)}")
    found = (compiled.string, tuple(order))
    _cache[key] = found  # statements are module-level constants: the cache stays small
    return found


def _driver_execute(conn: Connection, statement: Statement, params: Mapping[str, Any]) -> Any:
    sql, order = _compiled(conn, statement, tuple(params))
    values = [params.get(name, default) for name, default in order]
    try:
        return conn.connection.driver_connection.execute(sql, values)  # type: ignore[union-attr]
    except sqlite3.Error as exc:
        # As SQLAlchemy would raise it (IntegrityError, OperationalError…), so callers
        # catch one kind of error whichever way the statement ran.
        raise sa.exc.DBAPIError.instance(sql, values, exc, sqlite3.Error) from exc


def write(conn: Connection, statement: Statement, params: Mapping[str, Any]) -> int:
    """Execute an INSERT/UPDATE/DELETE; the number of rows it changed."""
    if conn.dialect.name == "sqlite":
        return int(_driver_execute(conn, statement, params).rowcount)
    _compiled(conn, statement, tuple(params))  # the same check of the names (cached)
    return int(conn.execute(statement, dict(params)).rowcount)


def row(conn: Connection, statement: Statement, params: Mapping[str, Any]) -> tuple[Any, ...]:
    """The first row of a query that returns one (an aggregate), as a tuple."""
    if conn.dialect.name == "sqlite":
        return tuple(_driver_execute(conn, statement, params).fetchone())
    return tuple(conn.execute(statement, dict(params)).one())
