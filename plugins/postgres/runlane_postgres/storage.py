"""The Postgres storage driver: ``StorageDriver`` with ordered append, exclusive candidates and
operator reads, over psycopg 3 (async) and a psycopg_pool connection pool.

Mechanics (``migration.py`` holds the schema and the ``runlane_commit`` function):

* **Reads outside a database transaction.** An attempt holds one pooled connection in autocommit
  mode; ``get`` and ``query_candidates`` are single plain ``SELECT`` statements. Every key read joins
  the read set with the version seen (``None`` when absent), like the in-memory reference.
* **One statement, one round trip per commit.** The staged work goes to ``runlane_commit`` as one
  ``jsonb`` document, run as one statement in its own implicit transaction: transaction-scoped
  advisory locks on every read and written key, taken in one global order (64-bit key hashes,
  sorted) so attempts never deadlock each other, exclusive for written keys and shared for keys only
  read; then one re-check of every read version and expected absence (blind creates included), made
  after the locks so it sees every earlier commit; then the writes. A failed check writes nothing and
  the callback is replayed, like ``memory.py``; so are ``40001`` / ``40P01``, a unique violation and a
  connection lost before the commit (once). A read-only attempt with more than one read statement
  re-checks its read set with one ``SELECT``.
* **Group commit.** While one commit of a driver is in flight, the attempts that reach their commit
  queue up; the first of them then commits them all in one ``runlane_commit_batch`` statement (one
  transaction, one WAL flush): every lock of the batch first, in the same global order, then each
  attempt's ``runlane_commit`` in a subtransaction of its own, so a later attempt sees the earlier
  ones' writes and an attempt that fails (or whose reads changed) is rolled back or replayed alone.
* **Event loops.** A psycopg pool, its connections and its waiters belong to the loop that opened
  it, so each loop that uses the driver has its own pool and its own group commit (``_LoopState``);
  ``close()`` closes each pool on its own loop. A forked child process refuses the driver it
  inherited (``storage_unavailable``): its connections are the parent's.
* **Hot statements** (point reads, index pages, commits, read validation, hints) are prepared once
  per connection and run through libpq directly with text parameters and results; statements that
  go together (``BEGIN`` and a transaction's first exclusive scan, its commit and ``COMMIT``) share
  one round trip in libpq's pipeline mode. psycopg's cursor layer serves the rest (operator reads).
* **Ordered append.** The stream head is an ordinary record. After the point writes, the commit
  function takes the head key's lock, reads the head, allocates contiguous positions after it and
  writes the records and the new head, so aborted or replayed attempts consume no positions and
  appenders to one stream hold its lock only for the append and the commit. Documents are exactly
  ``materialize_storage_append``'s: the driver sends each record's text around the position digits.
* **Exclusive candidates.** The first exclusive ``query_candidates`` of an attempt opens a database
  transaction; each candidate, in query order, is kept only if ``pg_try_advisory_xact_lock`` (a key
  space of its own) succeeds, so busy records are skipped and exactly the returned ones stay held
  until the attempt commits or rolls back. Writers are never blocked by these holds (core re-reads and
  version-checks every candidate anyway), so holds cannot deadlock with commits. (Row locks from
  ``FOR UPDATE SKIP LOCKED`` would block every writer of a held record until the holder ends and could
  deadlock with the commit locks.)
* **Versions** come from a sequence: positive, never reused, new on every create and replace.
* **Documents** are stored once, as ``json``, exactly as written (``jsonb`` would rewrite numbers
  such as ``1e+16`` or ``-0.0``): a point read returns the same canonical text. A row whose document is
  not a schema-version-1 envelope is corruption (``invariant_violation``), never skipped.
* **Operator projection**: ``runlane.storage.operator_sql`` rows, written by the same commit.
* **Wake hints** (``StorageWakeHints``): a trigger's hint rides in its commit (the attempt's
  ``wake_hint``: ``pg_notify`` inside the commit function, delivered when it commits), unless one for
  that queue went out within ``wake_hint_interval``. Such hints, and ``publish_wake_hint``'s, are held
  back until the interval has passed; then the next commit of the driver carries them, or, when none
  comes within another interval, one ``NOTIFY`` on the schema's channel from a connection of its own
  (outside the pool) sends everything held back.
  ``subscribe_wake_hints`` keeps one extra connection ``LISTEN``-ing while anyone is subscribed, so a
  trigger in one process wakes idle poll workers in the others before their poll delay ends. When that
  connection is lost, the one that replaces it hands subscribers ``"*"`` for the hints sent meanwhile.
* **Client clock**: ``now()`` samples the injected clock once per attempt (``use_clock`` like
  ``memory.py``). Clock skew between processes can cause early duplicate execution or brief capacity
  oversubscription; version and ownership fences still protect every write.

Errors: lost connections, SQLSTATE class ``08``, ``57P01``-``57P03``, timeouts (``57014``, ``55P03``), class
``53`` (a full disk, no connection slot, out of memory) and a read-only server (``25006``) map to
``storage_unavailable`` (retryable); ``40001`` / ``40P01`` past the replay budget to ``storage_conflict``; a
missing schema, table or function to ``configuration_invalid`` telling the user to run ``runlane postgres
migrate`` (``start()`` checks every table, the sequence and the functions, and names the database's other
Runlane schemas when the lane's is missing), and so do bad credentials (``28xxx``) and a missing database
(``3D000``); a reserved name (``42939``, a ``pg_`` schema) is ``configuration_invalid`` too, and so is a
prepared statement missing from the session or taken in it (``26000`` / ``42P05``: a pooler sharing sessions
between clients, which ``start()`` refuses when it sees one); anything else maps to ``internal_error``. Every
mapped error keeps the psycopg failure as its ``cause``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import unquote

import orjson
import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg.types.string import TextBinaryLoader, TextLoader
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from runlane.models import Environment, Page, RunEventRecord, RunRecord, RunSummary, environment_key
from runlane.storage import (
    NewStorageRecord,
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageLimits,
    StorageProfile,
    StorageQuery,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    decode_storage_query_cursor,
    decode_storage_tuple,
    encode_storage_tuple,
    materialize_storage_append,
    read_storage_stream_position,
    storage_stream_layouts,
)
from runlane.storage.attempt import (
    StagedWrite,
    StorageAttempt,
    WrittenDocuments,
    check_storage_keys,
    contract_violation,
    enforce_storage_limit,
    page_index_rows,
    pause_before_replay,
)
from runlane.storage.clock import ClientClock, Clock, SystemClock, checked_clock
from runlane.storage.key_order import key_ordered_range, repeats_key
from runlane.storage.operator_sql import (
    finish_event_page,
    finish_run_page,
    is_operator_event_key,
    is_operator_run_key,
    operator_event_row,
    operator_run_row,
    run_event_list_query,
    run_list_query,
)
from runlane.storage.streams import storage_append_rows, storage_append_templates
from runlane.storage.types import INDEX_ENTRY_LIMIT
from runlane.storage.tables import corrupt_stored_record, peek_run_document, run_key, run_tombstone_key
from runlane.vocabulary import SortDirection

from .migration import (
    DEFAULT_SCHEMA,
    OTHER_SCHEMAS_QUERY,
    SCHEMA_VERSION,
    encoding_error,
    ledger_query,
    likeliest_schemas,
    newer_schema_error,
    quote_schema,
    validate_schema_name,
)

#: A process whose clock is this far off the server's is warned at start (``runlane.clock``).
CLOCK_SKEW_WARNING_S = 1.0

_clock_log = logging.getLogger("runlane.clock")

__all__ = [
    "CLOCK_SKEW_WARNING_S",
    "PostgresConnectionTarget",
    "PostgresStorageDriver",
    "map_postgres_error",
    "postgres_storage",
    "resolve_postgres_connection",
]

T = TypeVar("T")

MIGRATE_HINT = "run `runlane postgres migrate` (or apply postgres_migration_sql()) before starting"
# What to do about a pooler that shares server sessions between clients (transaction or statement pooling).
SESSION_POOLING_HINT = (
    "Runlane keeps state in each connection's server session (prepared statements, its statement_timeout, "
    "LISTEN for wake hints), so connect the lane to a pool in session mode that resets each session before "
    "another client gets it (PgBouncer: pool_mode = session, server_reset_query = DISCARD ALL, its default) or "
    "to the server itself"
)


# ---------------------------------------------------------------------------------------------
# Connection strings


def _invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta)


@dataclass(frozen=True, slots=True)
class PostgresConnectionTarget:
    """A connection string with Runlane's ``schema`` parameter resolved and removed."""

    conninfo: str = field(repr=False)  # may hold a password
    schema: str
    parameters: frozenset[str]  # query parameter names the URL sets itself
    display: str  # host/database without credentials, for messages

    def connection_defaults(self, *, connect_timeout: float) -> dict[str, Any]:
        """libpq parameters Runlane adds unless the URL sets them: bounded connects and keepalives."""
        defaults: dict[str, Any] = {
            "connect_timeout": max(1, round(connect_timeout)),
            "keepalives": 1,
            "keepalives_idle": 30,
            "keepalives_interval": 10,
            "keepalives_count": 3,
            # Data the server does not acknowledge for this long (packets dropped by a partition or a
            # failover) closes the connection; keepalives only cover an idle one.
            "tcp_user_timeout": _TCP_USER_TIMEOUT_MS,
            "fallback_application_name": "runlane",
        }
        return {name: value for name, value in defaults.items() if name not in self.parameters}


#: The hint subscribers get for hints that may have been lost: any queue, any run's cancellation.
_ANY_HINT = "*"

_TCP_USER_TIMEOUT_MS = 30_000
# How much longer than statement_timeout a call waits for the server's answer before it gives the
# connection up (see ``_ready``).
_ANSWER_MARGIN_S = 5.0

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_PERCENT_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


# libpq parameters whose values are secrets: the password, the client key's passphrase, OAuth and SCRAM keys.
_SECRET_PARAMETERS = frozenset(
    {"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"}
)


@functools.cache
def _libpq_parameters() -> frozenset[str]:
    """The query parameter names libpq accepts (``ssl=true`` is its JDBC-style alias of ``sslmode=require``)."""
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()) | {"ssl"}


def _percent_encode_hint(where: str = "the password") -> str:
    return f"percent-encode special characters such as % / ? # @ and spaces in {where} (% as %25, / as %2F, @ as %40)"


@dataclass(frozen=True, slots=True)
class _UriParts:
    """A ``postgres://`` URL split the way libpq splits it (``conninfo_uri_parse_options``), which is not
    RFC 3986's way: the user name and password end at the first ``@`` that comes before any ``/`` (a
    ``?`` or ``#`` does not end them), the hosts at the first ``/`` or ``?`` outside ``[...]``, and
    ``#`` is an ordinary character."""

    scheme: str
    userinfo: str | None
    hosts: str
    path: str | None  # the database: after the "/" that ends the hosts, up to "?"
    query: str | None

    @classmethod
    def split(cls, scheme: str, rest: str) -> _UriParts:
        userinfo: str | None = None
        credentials = re.match(r"[^@/]*@", rest)
        if credentials is not None:
            userinfo, rest = rest[: credentials.end() - 1], rest[credentials.end() :]
        end, bracketed = len(rest), False
        for index, char in enumerate(rest):
            if char == "[":
                bracketed = True
            elif char == "]":
                bracketed = False
            elif char in "/?" and not bracketed:
                end = index
                break
        hosts, rest = rest[:end], rest[end:]
        if rest.startswith("/"):
            path, separator, query = rest[1:].partition("?")
            return cls(scheme, userinfo, hosts, path, query if separator else None)
        return cls(scheme, userinfo, hosts, None, rest[1:] if rest else None)

    def parameters(self) -> list[tuple[str, str, str]]:
        """Each query parameter as (raw text, decoded name, decoded value), as libpq splits them."""
        pieces = []
        for piece in self.query.split("&") if self.query is not None else ():
            name, _, value = piece.partition("=")
            pieces.append((piece, unquote(name), unquote(value)))
        return pieces

    def passwords(self) -> list[str]:
        """The password of the user information and the value of each secret-bearing parameter
        (``password``, ``sslpassword``, ...), as written."""
        found = [piece.partition("=")[2] for piece, name, _ in self.parameters() if name in _SECRET_PARAMETERS]
        if self.userinfo is not None and ":" in self.userinfo:
            found.insert(0, self.userinfo.split(":", 1)[1])
        return found

    def secrets(self) -> list[str]:
        """Text no message may quote: the user information when it holds a password, and every password
        and other secret parameter value as written and decoded. (A user name alone is no secret: the
        server's own messages name it.)"""
        found = [self.userinfo] if self.userinfo is not None and ":" in self.userinfo else []
        for password in self.passwords():
            found.extend(text for text in {password, unquote(password)} if text)
        return found

    def conninfo(self, kept: Sequence[str]) -> str:
        # Rebuilt from its parts: urlunsplit would drop the "//" of a URL without a host
        # (postgresql:///app?host=/run/pg, a Unix socket), which libpq then cannot parse.
        text = f"{self.scheme}://"
        if self.userinfo is not None:
            text += f"{self.userinfo}@"
        text += self.hosts
        if self.path is not None:
            text += f"/{self.path}"
        if kept:
            text += "?" + "&".join(kept)
        return text


def _check_credentials(parts: _UriParts) -> None:
    """Refuse a user name, password or query parameter value (``password``, ``sslpassword``, ...) libpq
    would misread or refuse, with a message that names it and quotes none of it (libpq's own parse errors
    quote the offending text)."""

    if any("@" in part for part in (parts.hosts, parts.path or "", parts.query or "")):
        # A password with "/" (libpq then reads the user name as the host and the password as the port)
        # or with a second "@" (the rest of the password becomes the host, database or a query parameter):
        # refused before anything else looks at those parts, since any message about them would quote a
        # piece of the password.
        raise _invalid(
            "The Postgres connection string has an '@' after its user name and password (in its host, "
            "database name or query), so libpq would read part of the password as the host, port, database "
            f"or a parameter: write an '@' in a parameter value as %40, and {_percent_encode_hint()}.",
            field="connection_string",
        )
    tokens: list[tuple[str, str, str]] = []  # (what, where to percent-encode, text as written)
    if parts.userinfo is not None:
        if "?" in parts.userinfo and "=" in parts.userinfo.split("?", 1)[1]:
            # "postgresql://db?password=p@ss": libpq reads "db?password=p" as a user name and "ss" as the host.
            raise _invalid(
                "The Postgres connection string has an '@' after a '?', which libpq reads as the end of a user "
                "name and password, not as part of a query parameter: write an '@' in a parameter value as %40, "
                f"and {_percent_encode_hint()}.",
                field="connection_string",
            )
        user, colon, password = parts.userinfo.partition(":")
        tokens.append(("user name", "the user name", user))
        if colon:
            tokens.append(("password", "the password", password))
    tokens.extend(_parameter_tokens(parts))
    for what, where, token in tokens:
        if _PERCENT_ESCAPE.search(token):
            problem = "has a '%' that does not start a percent-encoded byte (%XX)"
        elif "%00" in token:
            problem = "encodes a zero byte (%00), which libpq refuses"
        elif " " in token:
            problem = "has a space"
        elif "=" in token and what.endswith("parameter"):
            problem = "has a second '=' (write an '=' in a value as %3D)"
        else:
            continue
        raise _invalid(
            f"The Postgres connection string's {what} {problem}: {_percent_encode_hint(where)}.",
            field="connection_string",
        )


def _parameter_tokens(parts: _UriParts) -> list[tuple[str, str, str]]:
    """Each query parameter's value to check, refusing the pieces after a secret parameter that libpq's
    own messages would quote although they may be a part of the secret (``?sslpassword=ab&cd``: an '&'
    in the value that is not percent-encoded): a piece without ``=``, or a name libpq does not know."""
    tokens: list[tuple[str, str, str]] = []
    pieces = parts.parameters()
    previous = ""
    for index, (piece, name, _) in enumerate(pieces):
        if previous in _SECRET_PARAMETERS:
            lacks_separator = "=" not in piece and bool(piece or index < len(pieces) - 1)  # a trailing "&" is fine
            unknown = "=" in piece and name != "schema" and name not in _libpq_parameters()
            if lacks_separator or unknown:
                problem = "without '='" if lacks_separator else "libpq does not know"
                raise _invalid(
                    f"The Postgres connection string has a query parameter {problem} after its {previous} parameter: "
                    f"percent-encode an '&' in the {previous} value as %26, and write each parameter as name=value "
                    "with a name libpq knows.",
                    field="connection_string",
                )
        previous = name
        if name == "schema" or "=" not in piece:  # Runlane's own, checked as a schema name; libpq names the other
            continue
        secret = name in _SECRET_PARAMETERS
        where = "the password" if name == "password" else f"the {name} value" if secret else "parameter values"
        tokens.append((f"{name} parameter" if name else "query parameter", where, piece.partition("=")[2]))
    return tokens


def resolve_postgres_connection(connection_string: object, schema: object | None = None) -> PostgresConnectionTarget:
    """Check a ``postgres://`` / ``postgresql://`` URL and resolve its schema.

    The explicit ``schema`` wins, then a Prisma-style ``?schema=`` query parameter (always removed
    before connecting), then ``public``. The schema must be a plain identifier; it is always quoted.
    The URL is split the way libpq splits it; no message quotes its user name or password (a password
    with special characters must be percent-encoded, as libpq requires).
    """
    if not isinstance(connection_string, str) or not connection_string.strip():
        raise _invalid("The Postgres connection string must be a non-empty postgres:// or postgresql:// URL.")
    scheme, separator, rest = connection_string.strip().partition("://")
    if not separator or scheme.lower() not in ("postgres", "postgresql"):
        got = f"{scheme}://" if separator and _SCHEME.fullmatch(scheme) else "no scheme"
        raise _invalid(
            f"The Postgres connection string must start with postgres:// or postgresql:// (got {got}).",
            field="connection_string",
        )
    parts = _UriParts.split(scheme.lower(), rest)  # libpq recognizes only the lowercase schemes
    _check_credentials(parts)
    kept: list[str] = []
    names: set[str] = set()
    from_url: list[str] = []
    for piece, name, value in parts.parameters():
        if name == "schema":
            from_url.append(value)
            continue
        names.add(name)
        kept.append(piece)
    if len(set(from_url)) > 1:
        raise _invalid("The Postgres connection string names more than one ?schema= value.", field="schema")
    if schema is not None:
        resolved = validate_schema_name(schema)
    elif from_url:
        resolved = validate_schema_name(from_url[0])
    else:
        resolved = DEFAULT_SCHEMA
    conninfo = parts.conninfo(kept)
    _check_conninfo(conninfo, parts)
    host = unquote(parts.hosts)
    if not host:
        hosts = [value for _, name, value in parts.parameters() if name == "host"]
        host = hosts[0] if hosts else "localhost"
    if host.startswith("/"):  # a Unix socket directory
        display = f"socket {host}, database {parts.path or '(default)'}"
    else:
        display = f"{host}/{parts.path or ''}"
    return PostgresConnectionTarget(conninfo, resolved, frozenset(names), display)


# Options libpq reads as whole numbers (comma-separated, one per host, for ``port``), and the choices
# of the enumerated ones: checked when the driver is built, since libpq checks them only on connect.
_INTEGER_OPTIONS = frozenset(
    {"port", "connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count",
     "tcp_user_timeout"}
)  # fmt: skip
_TLS_ORDER = ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3")
_TLS_VERSIONS = frozenset(_TLS_ORDER)
_CHOICE_OPTIONS = {
    "sslmode": frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}),
    "channel_binding": frozenset({"disable", "prefer", "require"}),
    "ssl_min_protocol_version": _TLS_VERSIONS,
    "ssl_max_protocol_version": _TLS_VERSIONS,
    "target_session_attrs": frozenset({"any", "read-write", "read-only", "primary", "standby", "prefer-standby"}),
    "gssencmode": frozenset({"disable", "prefer", "require"}),
    "load_balance_hosts": frozenset({"disable", "random"}),
}


# The values of libpq's ``replication`` option that ask for an ordinary connection (the server reads it as a
# boolean, and also takes ``database``: a logical replication connection, which runs only simple queries).
_NOT_REPLICATION = frozenset({"", "0", "f", "fa", "fal", "fals", "false", "n", "no", "of", "off"})


def _check_conninfo(conninfo: str, parts: _UriParts) -> None:
    """Refuse what libpq would refuse on every connect (an unknown option, a port that is not a
    number, an unknown sslmode), so a typo is ``configuration_invalid`` up front, not an outage."""
    try:
        options = conninfo_to_dict(conninfo)
    except psycopg.Error as error:
        detail = str(error).strip().rstrip(".")
        # Some of libpq's parse errors quote the whole URL; others quote the offending token.
        detail = detail.replace(conninfo, _redacted(parts))
        if any(secret in detail for secret in parts.secrets()):
            detail = (
                "libpq could not parse it (its message is left out: it would quote the password); if the "
                f"password has special characters, {_percent_encode_hint()}"
            )
        raise _invalid(f"The Postgres connection string is not valid: {detail}.", field="connection_string") from None
    for name, value in options.items():
        text = str(value)
        if name in _INTEGER_OPTIONS and not all(part.strip().isdigit() for part in text.split(",") if part.strip()):
            raise _invalid(
                f"The Postgres connection string sets {name} to {text!r}; it must be a whole number.",
                field="connection_string",
            )
        if name == "port" and not all(0 < int(part) < 65536 for part in text.split(",") if part.strip()):
            raise _invalid(
                f"The Postgres connection string sets port to {text!r}; a port is between 1 and 65535.",
                field="connection_string",
            )
        if name == "replication" and text.lower() not in _NOT_REPLICATION:
            raise _invalid(
                f"The Postgres connection string sets replication to {text!r}; Runlane needs an ordinary "
                "connection (a replication connection cannot run its statements): remove replication from it.",
                field="connection_string",
            )
        choices = _CHOICE_OPTIONS.get(name)
        if choices is not None and text not in choices:
            raise _invalid(
                f"The Postgres connection string sets {name} to {text!r}; use one of {', '.join(sorted(choices))}.",
                field="connection_string",
            )
    lowest, highest = options.get("ssl_min_protocol_version"), options.get("ssl_max_protocol_version")
    if lowest and highest and _TLS_ORDER.index(lowest) > _TLS_ORDER.index(highest):
        # libpq refuses the range before every connection attempt, which read as the server being unreachable.
        raise _invalid(
            f"The Postgres connection string sets ssl_min_protocol_version to {lowest!r}, above its "
            f"ssl_max_protocol_version {highest!r}; no TLS version is left to connect with.",
            field="connection_string",
        )


def _redacted(parts: _UriParts) -> str:
    """The URL with its user information and every query parameter's value masked (the parameter names
    are kept): a value may be a secret (``password``, ``sslpassword``, ...) or a part of one."""
    userinfo = None if parts.userinfo is None else "***"
    text = _UriParts(parts.scheme, userinfo, parts.hosts, parts.path, None).conninfo(())
    if parts.query is not None:
        text += f"?{parts.query}"
    # Split here rather than with parts.parameters(): a host with an unclosed "[" runs to the end of the URL.
    base, separator, query = text.partition("?")
    if not separator:
        return base
    masked = (f"{piece.partition('=')[0]}=***" if "=" in piece else piece for piece in query.split("&"))
    return f"{base}?" + "&".join(masked)


def check_seconds(option: str, seconds: object) -> None:
    """``configuration_invalid`` unless ``seconds`` is a positive, finite number (a timeout option)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise _invalid(f"{option} must be a positive number of seconds.")


# ---------------------------------------------------------------------------------------------
# Errors


_UNAVAILABLE_STATES = frozenset({"57P01", "57P02", "57P03", "53100", "53300", "57014", "25006", "55P03"})
_CONFLICT_STATES = frozenset({"40001", "40P01", "23505"})
# A migration refused on one of the schema's objects (not on the schema or the database): another role owns it.
_OBJECT_PERMISSION = re.compile(r"permission denied for (table|sequence|function|relation) ")
_MIGRATION_STATES = frozenset({"3F000", "42P01", "42883", "42703", "42704"})
# A statement the connection prepared is gone (26000), or its name is taken already (42P05): the connection's
# server session is not its own, which a pooler in transaction or statement mode does.
_POOLED_STATES = frozenset({"26000", "42P05"})


class _Replay(Exception):
    """The attempt rolled back before committing anything and may be replayed: a supported conflict,
    or a connection lost during the read phase."""


# A role's or database's CONNECTION LIMIT reached (its kind in group 1).
_CONNECTION_LIMIT = re.compile(r'too many connections for (role|database) "')
# libpq reports a refused connection without an SQLSTATE; these server messages (English, the
# server's default) name the ones a user must fix rather than wait out.
_CONNECT_FAILURES = (
    (re.compile(r'FATAL:\s+database ".*" does not exist'), "3D000"),
    # PgBouncer's words for a database its [databases] section does not list.
    (re.compile(r"FATAL:\s+no such database: "), "3D000"),
    (re.compile(r'FATAL:\s+role ".*" does not exist'), "28000"),
    (re.compile(r"FATAL:\s+\S+ authentication failed"), "28P01"),
    # libpq's own: the server asks for a password and neither the URL, PGPASSWORD nor the passfile has one.
    (re.compile(r"fe_sendauth: no password supplied"), "28P01"),
    (re.compile(r"FATAL:\s+no pg_hba\.conf entry"), "28000"),
    (re.compile(r"FATAL:\s+permission denied for database"), "42501"),
    # The server is full (max_connections; the last slots are kept for superusers, PG 15 and 16 wording), or
    # the role or database has all the connections its CONNECTION LIMIT allows.
    (
        re.compile(
            r"FATAL:\s+((sorry, )?too many clients|remaining connection slots are reserved|"
            + _CONNECTION_LIMIT.pattern
            + ")"
        ),
        "53300",
    ),
    (re.compile(r"FATAL:\s+the database system is (starting up|shutting down|in recovery mode)"), "57P03"),
    # A setting in the connection string's ``options`` the server refuses, on every connect.
    (re.compile(r"FATAL:\s+(invalid value for parameter|unrecognized configuration parameter)"), "22023"),
)

# libpq's own refusal of a server that does not accept SSL while the connection string requires it
# (sslmode=require, verify-ca or verify-full): the same on every connect, so not an outage to wait out.
_SSL_REFUSED = re.compile(r"server does not support SSL, but SSL was required")
# libpq's own refusal of the connection's TLS files or of the server's certificate (sslrootcert, sslcert,
# sslkey, verify-ca / verify-full): the same on every connect as well, until the settings or files change.
_TLS_REFUSED = re.compile(
    r'root certificate file "[^"]*" does not exist|could not read root certificate file|certificate verify failed'
    r'|server certificate for "[^"]*".* does not match host name|could not (open|read) certificate file'
    r'|could not load private key file|certificate present, but not private key file|private key file "[^"]*" '
    r"(has group or world access|is not a regular file)|certificate does not match private key file"
)
# libpq's own refusal of a ``service`` it cannot look up (no such service, no service file, a line it cannot
# read there): the same on every connect too.
_SERVICE_REFUSED = re.compile(r'(definition of service|service file) "[^"]*" not found|in service file "')

# A pooler's refusal of a startup parameter it does not pass on (PgBouncer refuses `options`, for one):
# the same on every connect as well.
_POOLER_PARAMETER_REFUSED = re.compile(r"FATAL:\s+unsupported startup parameter")

# What the connection string must change for each of those refusals ({detail}: libpq's message).
_LIBPQ_REFUSALS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        _POOLER_PARAMETER_REFUSED,
        "the connection pooler in front of the server refuses a parameter of the connection string ({detail}); "
        "remove it from the connection string, or have the pooler ignore it (PgBouncer: "
        "ignore_startup_parameters).",
    ),
    (
        _SSL_REFUSED,
        "the server does not accept SSL connections ({detail}); enable SSL on the server, or connect without SSL "
        "by leaving sslmode out of the connection string (or setting it to prefer or disable).",
    ),
    (
        _TLS_REFUSED,
        "libpq refused the connection's TLS certificates or keys ({detail}); fix the file or the connection "
        "string's sslrootcert, sslcert, sslkey or sslmode (verify-ca and verify-full check the server's "
        "certificate against sslrootcert, by default ~/.postgresql/root.crt).",
    ),
    (
        _SERVICE_REFUSED,
        "libpq cannot look up the connection string's service ({detail}); define the service in the connection "
        "service file (PGSERVICEFILE, else ~/.pg_service.conf), or drop service from the connection string and "
        "name the host, port and database in it.",
    ),
)

def _sqlstate(error: BaseException) -> str | None:
    state = getattr(error, "sqlstate", None)
    if state is None and isinstance(error, psycopg.OperationalError):
        text = str(error)
        for pattern, candidate in _CONNECT_FAILURES:
            if pattern.search(text):
                return candidate
    return state


def _alive(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a pooled connection looks usable, without a round trip. An idle connection receives
    nothing, so anything readable on its socket (a termination notice, the end of the stream) means
    the server closed it or is about to; it is dropped rather than risked on a commit."""
    pgconn = conn.pgconn
    if pgconn.status != _CONNECTION_OK:
        return False
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN | select.POLLERR | select.POLLHUP)
        return not poller.poll(0)
    except (OSError, ValueError, psycopg.Error):
        return False


def _is_conflict(error: BaseException) -> bool:
    return _sqlstate(error) in _CONFLICT_STATES


def _is_disconnect(error: BaseException) -> bool:
    state = _sqlstate(error)
    if state is not None:
        return state.startswith("08") or state in ("57P01", "57P02", "57P03")
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)) and not isinstance(error, PoolTimeout)


def map_postgres_error(error: BaseException, doing: str, *, migrating: bool = False) -> RunlaneError:
    """The ``RunlaneError`` for a psycopg / pool failure while ``doing`` something.

    The failure is kept as the error's ``cause`` (``__cause__``), so a logged traceback shows the driver's
    whole report (SQLSTATE detail, PL/pgSQL context); ``to_json()`` leaves it out.
    """
    if isinstance(error, RunlaneError):
        return error
    state = _sqlstate(error)
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    meta: dict[str, Any] = {"sqlstate": state} if state else {}

    def mapped(code: ErrorCode, problem: str, *, retryable: bool = False) -> RunlaneError:
        return RunlaneError(code, f"Could not {doing}: {problem}", retryable=retryable, meta=meta, cause=error)

    unavailable = ErrorCode.STORAGE_UNAVAILABLE
    invalid = ErrorCode.CONFIGURATION_INVALID
    if isinstance(error, PoolTimeout):
        return mapped(
            unavailable,
            f"no Postgres connection became available in time ({detail}): every connection of the pool was in use "
            "and it could open no other (it holds the lane's max_size, or connecting failed); retry the operation, "
            "and when this recurs raise the lane's max_size (within the server's max_connections) or pool_timeout, "
            "or make fewer calls at once.",
            retryable=True,
        )
    if isinstance(error, PoolClosed):
        # The lane closed while the call waited for a connection (a runtime closed with calls still running):
        # the server is fine, and the call cannot succeed by being retried on this lane.
        return mapped(unavailable, f"the lane was closed meanwhile ({detail}); nothing was done.")
    if state is None and isinstance(error, psycopg.OperationalError):
        for refusal, problem in _LIBPQ_REFUSALS:
            if refusal.search(detail):
                return mapped(invalid, problem.format(detail=detail))
    if state is None and isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)):
        return mapped(unavailable, f"Postgres is unreachable ({detail}).", retryable=True)
    if state == "53300":
        limit = _CONNECTION_LIMIT.search(detail)
        raise_limit = (
            "the server's max_connections"
            if limit is None
            else f"the {limit.group(1)}'s CONNECTION LIMIT (ALTER {limit.group(1).upper()} ... CONNECTION LIMIT)"
        )
        return mapped(
            unavailable,
            f"Postgres has no connection slot left [{state}] ({detail}); lower the pools' max_size or the number "
            f"of processes, or raise {raise_limit}.",
            retryable=True,
        )
    if state == "53100":
        return mapped(
            unavailable,
            f"the database's disk is full [{state}] ({detail}); nothing was written. Free space on the database "
            "server's disk (its data directory, tablespaces and pg_wal) or enlarge it, then retry the operation.",
            retryable=True,
        )
    if state == "25006":
        return mapped(
            unavailable,
            f"Postgres accepts no writes here [{state}] ({detail}): this is a read-only standby, or the role or "
            "database sets default_transaction_read_only; connect to the primary (after a failover, the new one).",
            retryable=True,
        )
    if state == "57014" and "statement timeout" in detail:
        # The migration's connection keeps the statement_timeout of the role, the database or the URL's options.
        longer = (
            "apply it with a longer statement_timeout (options=-c%20statement_timeout%3D0 in the URL lifts it)"
            if migrating
            else "raise the lane's statement_timeout"
        )
        return mapped(
            unavailable,
            f"the statement ran past statement_timeout [{state}] ({detail}); retry the operation. When this "
            "recurs, look in pg_stat_activity for a session that holds locks for long (a long transaction, a "
            f"migration) or for an overloaded server, or {longer}.",
            retryable=True,
        )
    if state == "55P03":
        return mapped(
            unavailable,
            f"the wait for a lock another session holds ran past lock_timeout [{state}] ({detail}); retry the "
            "operation. When this recurs, look in pg_stat_activity for the session holding it (a long transaction, "
            "a migration), or raise the lock_timeout that the role, the database or the connection string sets.",
            retryable=True,
        )
    if state == "57014":
        return mapped(
            unavailable, f"Postgres cancelled the statement [{state}] ({detail}); retry the operation.", retryable=True
        )
    if state is not None and state.startswith("53"):
        # The rest of class 53 (insufficient resources): out of memory or of shared memory (53200: the lock
        # table, say), a configured limit reached (53400). The server stays up and the call may pass later.
        return mapped(
            unavailable,
            f"Postgres ran short of a resource [{state}] ({detail}); retry the operation. When this recurs, look "
            "in the server's log for what ran out (memory: work_mem and other sessions' use of it; shared memory: "
            "max_locks_per_transaction) and raise it, or make fewer calls at once.",
            retryable=True,
        )
    if state is not None and (state.startswith("08") or state in _UNAVAILABLE_STATES):
        return mapped(unavailable, f"Postgres is unavailable [{state}] ({detail}).", retryable=True)
    if state is not None and state in _CONFLICT_STATES:
        return create_storage_conflict_error(
            StorageConflictKind.TRANSACTION,
            f"Could not {doing}: a concurrent transaction conflicted [{state}] ({detail}); retry the operation.",
            meta=meta,
            cause=error,
        )
    if state is not None and (state.startswith("28") or state == "3D000"):
        return mapped(
            invalid,
            f"Postgres rejected the connection [{state}] ({detail}); check the connection string's user, password "
            "and database" + ("." if migrating else f", then {MIGRATE_HINT} Runlane."),
        )
    if state is not None and state in _MIGRATION_STATES and not migrating:
        return mapped(
            invalid, f"the Runlane schema is missing or incomplete [{state}] ({detail}); {MIGRATE_HINT} Runlane."
        )
    if state is not None and state.startswith("RL"):
        return mapped(ErrorCode.INVARIANT_VIOLATION, f"{detail}.")
    if state == "22023" and isinstance(error, psycopg.OperationalError):
        return mapped(
            invalid,
            f"Postgres refused a setting of the connection [{state}] ({detail}); fix the connection string's options.",
        )
    if state == "42501":
        if "for database" in detail:
            advice = "grant the role CREATE on the database, or create the schema beforehand with the role as its owner"
        elif migrating and ("must be owner of" in detail or _OBJECT_PERMISSION.search(detail)):
            # Owning the schema is not enough when an earlier migration, run by another role, created its tables.
            advice = (
                "the schema's Runlane tables, sequence and functions belong to another role (the one that migrated "
                "it before): migrate as that role, or make this one their owner (ALTER TABLE / SEQUENCE / FUNCTION "
                "... OWNER TO, for each runlane_ object of the schema)"
            )
        elif migrating:
            advice = "make the migrating role the schema's owner, or grant it CREATE on the schema"
        else:
            advice = "grant the Runlane role access to its schema (see the privileges in docs/lanes.md)"
        return mapped(invalid, f"permission denied ({detail}); {advice}.")
    if state in _POOLED_STATES:
        return mapped(
            invalid,
            f"a statement this connection prepared is missing from its server session, or another one holds its "
            f"name [{state}] ({detail}): the connection goes through a pooler that shares server sessions between "
            f"clients (transaction or statement pooling) or hands a session to the next client without resetting "
            f"it. {SESSION_POOLING_HINT}.",
        )
    if state == "42939":
        return mapped(
            invalid,
            f"Postgres reserves that name [{state}] ({detail}); names starting with pg_ are reserved for the system, "
            "so choose another schema name.",
        )
    return mapped(ErrorCode.INTERNAL_ERROR, f"Postgres error [{state}] ({detail}).")

# ---------------------------------------------------------------------------------------------
# Stored rows


_INDEX_NAMES = {name.value: name for name in StorageIndexName}


def _document(key: str, text: Any) -> StorageDocument:
    """The stored document, checked to be a schema-version-1 envelope (else ``invariant_violation``)."""
    if type(text) is not str:
        raise corrupt_stored_record(key, "its document is not JSON text")
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if text.startswith('{"schemaVersion":1,"value":{') and text.endswith("}}"):
        try:
            envelope = orjson.loads(text)
        except orjson.JSONDecodeError:
            envelope = None
        if type(envelope) is dict and len(envelope) == 2 and type(envelope.get("value")) is dict:
            version = envelope.get("schemaVersion")
            if type(version) is int and version == 1:
                return StorageDocument(text, size)
    try:
        return StorageDocument.parse(text)  # the exact reason, or a valid envelope written by another tool
    except RunlaneError as error:
        raise corrupt_stored_record(key, error.message.rstrip(".")) from None


@functools.lru_cache(maxsize=4096)
def _decoded_tuple(encoded: str) -> tuple[str, ...]:
    return decode_storage_tuple(encoded)


def _entries(key: str, text: Any) -> tuple[StorageIndexEntry, ...]:
    if not text:
        return ()
    entries = []
    try:
        for item in text.split(" "):
            name, partition, sort = item.split(",")
            entries.append(
                StorageIndexEntry._trusted(
                    _INDEX_NAMES[name], _decoded_tuple(partition), decode_storage_tuple(sort), partition, sort
                )
            )
    except (ValueError, KeyError, RunlaneError):
        raise corrupt_stored_record(key, "its index entries cannot be decoded") from None
    return tuple(entries)


def _encode_entries(entries: Iterable[StorageIndexEntry]) -> str:
    return " ".join([f"{entry.name._value_},{entry.encoded_partition},{entry.encoded_sort}" for entry in entries])


def _record(key: StorageRecordKey, version: Any, text: Any, indexes: Any, written: WrittenDocuments) -> StorageRecord:
    """A stored row as a record. A document whose text is exactly one this driver replaced under that
    key (``written``) is that document, already holding its decoded value: a run claimed and completed
    by one process is decoded once."""
    encoded = key.encoded
    if type(version) is not int or version < 1:
        raise corrupt_stored_record(encoded, "its version is not a positive integer")
    document = written.recall(encoded, text) or _document(encoded, text)
    return StorageRecord(key, str(version), document, _entries(encoded, indexes))


def _found_records(wanted: dict[str, StorageRecordKey], result: Any, written: WrittenDocuments) -> dict[str, StorageRecord]:
    """The records of a point-read result (text format: key, version, document, indexes)."""
    found: dict[str, StorageRecord] = {}
    value = result.get_value
    for row in range(result.ntuples):
        encoded = value(row, 0).decode("utf-8")
        key = wanted.get(encoded)
        if key is None:
            raise corrupt_stored_record(encoded, "a point read returned a key it did not ask for")
        version = value(row, 1)
        version = None if version is None else int(version)
        found[encoded] = _record(key, version, _text(value(row, 2)), _text(value(row, 3)), written)
    return found


def _lock_hash(salt: bytes, encoded_key: str) -> int:
    """A stable signed 64-bit advisory lock key for one record key of one schema."""
    digest = hashlib.blake2b(encoded_key.encode("utf-8"), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)


# Two materializations of one append at these starts differ exactly in the 20 position digits
# (every 20-digit u64 starts with "1"; the second digits differ), which locates them in the text.
_PROBE_A = 10**19
_PROBE_B = 17777777777777777777


def _split_append(command: StorageAppendCommand) -> list[tuple[str, str, int]]:
    """For each value: the canonical record text before and after its position digits, and the
    byte size of the record's document without the digits (what ``materialize_storage_append`` builds)."""
    templates = storage_append_templates(command)
    if templates is not None:
        return templates
    _, _, second = storage_append_rows(command, _PROBE_B)
    pieces = []
    for offset, (_, _, text, byte_size) in enumerate(second):
        # Only the position's digits depend on the position: when the probe's quoted digits occur
        # exactly once, they are the position and the rest is the same at every position.
        digits = f'"{_PROBE_B + offset}"'
        at = text.find(digits)
        if at < 0 or text.find(digits, at + 1) >= 0:
            return _split_append_compared(command)
        pieces.append((text[: at + 1], text[at + 21 :], byte_size - 20))
    return pieces


def _split_append_compared(command: StorageAppendCommand) -> list[tuple[str, str, int]]:
    """``_split_append`` for values whose text holds the probe digits too: compare two materializations."""
    first = materialize_storage_append(command, _PROBE_A).records
    second = materialize_storage_append(command, _PROBE_B).records
    pieces = []
    for offset, (a, b) in enumerate(zip(first, second, strict=True)):
        text_a, text_b = a.document.text, b.document.text
        digits_a, digits_b = str(_PROBE_A + offset), str(_PROBE_B + offset)
        at = text_a.rfind(f'"{digits_a}"') + 1
        located = at > 0 and text_b[at : at + 20] == digits_b
        if not (located and text_a[:at] == text_b[:at] and text_a[at + 20 :] == text_b[at + 20 :]):
            low, high = 0, len(text_a)  # the longest common prefix, by bisection
            while low < high:
                middle = (low + high + 1) // 2
                if text_a[:middle] == text_b[:middle]:
                    low = middle
                else:
                    high = middle - 1
            at = low - 1
            if text_a[at : at + 20] != digits_a or text_b[at : at + 20] != digits_b:  # pragma: no cover
                raise RunlaneError(ErrorCode.INTERNAL_ERROR, "Could not locate the position in an appended record.")
        pieces.append((text_a[:at], text_a[at + 20 :], a.document.byte_size - 20))
    return pieces


# ---------------------------------------------------------------------------------------------
# SQL


@dataclass(frozen=True, slots=True)
class _Statement:
    """A statement prepared once per connection (under ``name``) and run through libpq directly."""

    name: bytes
    text: bytes


def _statement(prefix: bytes, text: bytes) -> _Statement:
    """``text`` prepared under ``prefix`` and a hash of the text: a name never stands for two texts, so
    a connection that already holds the name (a pooler in transaction mode hands out a session another
    client prepared on, one whose lane uses another schema, say) never runs another statement under it;
    such a connection refuses to prepare or run the name instead."""
    return _Statement(prefix + b"_" + hashlib.blake2b(text, digest_size=8).hexdigest().encode("ascii"), text)


@dataclass(frozen=True, slots=True)
class _Sql:
    records: str
    index_rows: str
    operator_runs: str
    operator_events: str
    migrations: str
    get_run: str
    schema: str
    # The hot statements, prepared per connection (see ``_call``).
    get: _Statement
    validate: _Statement
    commit_prepared: _Statement
    commit_batch: _Statement

    def schema_objects(self) -> tuple[list[str], list[str]]:
        """The qualified names of the migration's tables and sequence, and the signatures of its functions: what
        ``start()`` checks is there."""
        relations = [self.migrations, self.records, self.index_rows, self.operator_runs, self.operator_events]
        relations.append(f"{self.schema}.runlane_record_versions")
        functions = [f"{self.schema}.runlane_commit(jsonb)", f"{self.schema}.runlane_commit_batch(jsonb,jsonb)"]
        return relations, functions

    @classmethod
    def for_schema(cls, schema: str) -> _Sql:
        s = quote_schema(schema)
        records = f"{s}.runlane_records"
        return cls(
            records=records,
            index_rows=f"{s}.runlane_index_rows",
            operator_runs=f"{s}.runlane_operator_runs",
            operator_events=f"{s}.runlane_operator_events",
            migrations=f"{s}.runlane_schema_migrations",
            schema=s,
            get_run=f"SELECT key, document FROM {records} WHERE key = ANY(%b::text[])",
            get=_statement(
                b"runlane_get",
                f"SELECT key, version, document, indexes FROM {records} WHERE key = ANY($1::text[])".encode(),
            ),
            validate=_statement(
                b"runlane_validate",
                (
                    "SELECT count(*) FROM unnest($1::text[], $2::bigint[]) AS d(key, version) "
                    f"LEFT JOIN {records} AS r ON r.key = d.key WHERE r.version IS DISTINCT FROM d.version"
                ).encode(),
            ),
            commit_prepared=_statement(
                b"runlane_commit", f"SELECT commit_status, commit_detail FROM {s}.runlane_commit($1::jsonb)".encode()
            ),
            commit_batch=_statement(
                b"runlane_commit_batch",
                (
                    "SELECT commit_status, commit_state, commit_message, commit_detail "
                    f"FROM {s}.runlane_commit_batch($1::jsonb, $2::jsonb)"
                ).encode(),
            ),
        )


_MAX_REMEMBERED_HINTS = 1024
_HINT_FLUSH_TIMEOUT_S = 1.0
_NOTIFY = _statement(b"runlane_notify", b"SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")


def _key_array(keys: Iterable[str]) -> bytes:
    """The text-format ``text[]`` literal of encoded keys (lowercase hex and ``/`` only: no escaping)."""
    return ('{"' + '","'.join(keys) + '"}').encode("ascii")


def _text_array(values: Iterable[str]) -> bytes:
    """The text-format ``text[]`` literal of arbitrary strings."""
    quoted = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return ("{" + ",".join(quoted) + "}").encode("utf-8")


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _NoAnswer(psycopg.OperationalError):
    """The server did not answer on an open connection in time: the connection was closed."""


async def _ready(pgconn: Any, *, writing: bool, deadline: float | None = None) -> None:
    """Wait on the event loop until the connection's socket is writable (or readable), until ``deadline``
    (loop time) at most: past it the connection is closed (what was sent may still run on the server) and
    ``_NoAnswer`` raised, so a server that stopped answering (a partition, a failover, a stalled host) fails
    the call as unavailable storage instead of holding it for as long as TCP takes to give up."""
    loop = asyncio.get_running_loop()
    fileno = pgconn.socket
    future = loop.create_future()
    if writing:
        loop.add_writer(fileno, _wake, future)
    else:
        loop.add_reader(fileno, _wake, future)
    timer = None if deadline is None else loop.call_at(deadline, _give_up, future)
    try:
        await future
    except _NoAnswer:
        pgconn.finish()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if writing:
            loop.remove_writer(fileno)
        else:
            loop.remove_reader(fileno)


def _give_up(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_NoAnswer("the server did not answer in time; the connection was closed"))


async def _exchange(pgconn: Any, *, pipeline: bool = False, within: float | None = None) -> list[Any]:
    """Send what libpq has queued on a nonblocking connection and collect every result until the
    server is ready again, waiting on the event loop (no psycopg cursor machinery). In pipeline
    mode: one result per command (its error, if it failed), up to the sync. ``within``: the seconds
    the whole exchange may take (see ``_ready``)."""
    deadline = None if within is None else asyncio.get_running_loop().time() + within
    while pgconn.flush():
        await _ready(pgconn, writing=True, deadline=deadline)
    results: list[Any] = []
    current: Any = None  # pipeline mode: the result of the command being read
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if not pipeline:
                if result is None:
                    return results
                results.append(result)
            elif result is None:  # the end of one command's results
                if current is not None:
                    results.append(current)
                    current = None
            elif result.status == _SYNC:
                return results
            elif current is None or current.status != _FATAL:
                current = result
        await _ready(pgconn, writing=False, deadline=deadline)


_FATAL = psycopg.pq.ExecStatus.FATAL_ERROR


def _result(results: list[Any]) -> Any:
    """The one result of a statement; a failed statement raises its ``psycopg.Error``."""
    for result in results:
        if result.status == _FATAL:
            raise psycopg.errors.error_from_result(result, encoding="utf-8")
    if len(results) != 1:  # pragma: no cover - one statement, one result
        raise psycopg.InterfaceError(f"expected one result, got {len(results)}")
    return results[0]


_PREPARED: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bytes]] = weakref.WeakKeyDictionary()
# Per connection: how long one call may wait for the server's answer (``_ready``), set when the driver
# configures the connection; a connection without one waits as long as it takes.
_ANSWER_WITHIN: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = weakref.WeakKeyDictionary()


async def _call(conn: psycopg.AsyncConnection[Any], statement: _Statement, params: Sequence[bytes | None]) -> Any:
    """Run ``statement`` (prepared on ``conn`` at its first use there) with text-format parameters;
    the result is in text format. The caller owns ``conn`` exclusively for the call (an attempt or a
    pooled read), so psycopg's own per-connection lock is not needed."""
    pgconn = conn.pgconn
    prepared = _PREPARED.get(conn)
    if prepared is None:
        prepared = _PREPARED[conn] = set()
    within = _ANSWER_WITHIN.get(conn)
    if statement.name not in prepared:
        pgconn.send_prepare(statement.name, statement.text)
        _result(await _exchange(pgconn, within=within))
        prepared.add(statement.name)
    pgconn.send_query_prepared(statement.name, params)
    return _result(await _exchange(pgconn, within=within))


async def _answered(conn: psycopg.AsyncConnection[Any], operation: Awaitable[T]) -> T:
    """``operation`` (statements on ``conn``, psycopg's cursors included) under the connection's answer
    deadline (``_ANSWER_WITHIN``, see ``_ready``): past it the connection's socket is shut down, which ends
    psycopg's wait for the answer, and ``_NoAnswer`` is raised."""
    within = _ANSWER_WITHIN.get(conn)
    if within is None:
        return await operation
    expired = False

    def give_up() -> None:
        nonlocal expired
        expired = True
        with contextlib.suppress(OSError, psycopg.Error):
            # Through a duplicate of its descriptor: the socket itself is shut down, and the wait on the
            # connection's own descriptor wakes to the end of the stream.
            with socket.socket(fileno=os.dup(conn.pgconn.socket)) as duplicate:
                duplicate.shutdown(socket.SHUT_RDWR)

    timer = asyncio.get_running_loop().call_later(within, give_up)
    try:
        return await operation
    except psycopg.Error as error:
        if expired:
            raise _NoAnswer("the server did not answer in time; the connection was closed") from error
        raise
    finally:
        timer.cancel()


_SYNC = psycopg.pq.ExecStatus.PIPELINE_SYNC
_ABORTED = psycopg.pq.ExecStatus.PIPELINE_ABORTED


async def _call_all(
    conn: psycopg.AsyncConnection[Any], calls: Sequence[tuple[_Statement | bytes, Sequence[bytes | None]]]
) -> list[Any]:
    """Run several statements in one round trip (libpq pipeline mode, one sync): each a prepared
    ``_Statement`` with its text-format parameters, or a parameterless command such as ``b"BEGIN"``.
    Returns each call's result in order; the first failed call raises its ``psycopg.Error`` (the
    server skipped the calls after it)."""
    pgconn = conn.pgconn
    prepared = _PREPARED.get(conn)
    if prepared is None:
        prepared = _PREPARED[conn] = set()
    expected: list[bytes | None] = []  # per result to come: the name a prepare defines, or None
    pgconn.enter_pipeline_mode()
    try:
        for statement, params in calls:
            if isinstance(statement, bytes):
                pgconn.send_query_params(statement, None)
            else:
                if statement.name not in prepared:
                    pgconn.send_prepare(statement.name, statement.text)
                    expected.append(statement.name)
                pgconn.send_query_prepared(statement.name, params)
            expected.append(None)
        pgconn.pipeline_sync()
        results = await _exchange(pgconn, pipeline=True, within=_ANSWER_WITHIN.get(conn))
    finally:
        with contextlib.suppress(psycopg.OperationalError):
            pgconn.exit_pipeline_mode()
    answers: list[Any] = []
    failure: Any = None
    for defined, result in zip(expected, results, strict=True):
        if result.status == _FATAL:
            failure = failure or result
        elif result.status != _ABORTED and defined is not None:
            prepared.add(defined)
        if defined is None:
            answers.append(result)
    if failure is not None:
        raise psycopg.errors.error_from_result(failure, encoding="utf-8")
    return answers


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8")


@functools.lru_cache(maxsize=128)
def _query_sql(index_rows: str, shape: tuple[bool, ...]) -> str:
    """One index page query: equality on (index, partition), the range bounds present, the cursor.

    For a key-ordered index name (``runlane.storage.key_order``) the page merges two ordered reads:
    the index rows of entries that do not restate their record's key, and the key range of the
    records whose keys do (each record checked to list the entry), both cut to the page size.

    The exclusive form also returns each held candidate's record (version, document, index entries;
    NULLs when it is absent), read by key in the same statement: the attempt reads them next."""
    gt, gte, lt, lte, has_cursor, descending, exclusive, key_ordered = shape
    bounds = ((gt, ">"), (gte, ">="), (lt, "<"), (lte, "<="))
    where = ["x.index_name = %s", "x.partition = %s"]
    where += [f"x.sort {operator} %s" for present, operator in bounds if present]
    if has_cursor:
        where.append(f"(x.sort, x.key) {'<' if descending else '>'} (%s, %s)")
    if key_ordered:
        # A row that restates its key (left by a process running an earlier version) is read from
        # the records instead: skip it here, or it would be returned twice.
        where.append("x.key <> %s || x.sort")
    direction = "DESC" if descending else "ASC"
    inner = (
        f"SELECT x.sort, x.key FROM {index_rows} AS x WHERE {' AND '.join(where)} "
        f"ORDER BY x.sort {direction}, x.key {direction}"
    )
    records = index_rows.rsplit(".", 1)[0] + ".runlane_records"
    if key_ordered:
        # The records' key range (KeyOrderedRange); a sort bound is the prefix + bound.
        keyed = ["r.key >= %s", "r.key < %s"]
        keyed += [f"r.key {operator} %s" for present, operator in bounds if present]
        if has_cursor:
            keyed.append(
                f"r.key {'<=' if descending else '>='} %s AND (substr(r.key, %s), r.key) "
                f"{'<' if descending else '>'} (%s, %s)"
            )
        keyed.append("strpos(' ' || r.indexes || ' ', %s || substr(r.key, %s) || ' ') > 0")
        by_key = (
            f"SELECT substr(r.key, %s) AS sort, r.key FROM {records} AS r WHERE {' AND '.join(keyed)} "
            f"ORDER BY r.key {direction}"
        )
        cut = "" if exclusive else " LIMIT %s"
        inner = (
            f"SELECT u.sort, u.key FROM (({inner}{cut}) UNION ALL ({by_key}{cut})) AS u "
            f"ORDER BY u.sort {direction}, u.key {direction}"
        )
    if not exclusive:
        return f"{inner} LIMIT %s"
    # Rows are tried in query order (OFFSET 0 keeps the ordered subquery intact, and the volatile lock
    # call is never pushed into it); the LIMIT stops trying once the page is full, so only returned
    # rows are ever locked and busy ones are skipped.
    held = (
        f"SELECT c.sort, c.key FROM ({inner} OFFSET 0) AS c "
        "WHERE pg_try_advisory_xact_lock(%s::integer, hashtext(c.key)) LIMIT %s"
    )
    # The records table is beside the index rows table. Each held row's record is looked up by key in
    # a lateral subquery (OFFSET 0 keeps it one): a nested loop over the held rows, which keeps their
    # order and probes the records' primary key once per row whatever the tables' sizes.
    return (
        f"SELECT h.sort, h.key, d.version, d.document, d.indexes FROM ({held}) AS h "
        f"LEFT JOIN LATERAL (SELECT r.version, r.document, r.indexes FROM {records} AS r "
        "WHERE r.key = h.key OFFSET 0) AS d ON true"
    )


@functools.lru_cache(maxsize=128)
def _query_statement(index_rows: str, shape: tuple[bool, ...]) -> _Statement:
    """``_query_sql`` with numbered placeholders, as a statement prepared per connection."""
    numbers = iter(range(1, 64))
    text = re.sub("%s", lambda _: f"${next(numbers)}", _query_sql(index_rows, shape)).encode("utf-8")
    return _statement(b"runlane_query", text)


def _encode_params(values: Iterable[Any]) -> list[bytes]:
    """Text-format parameters of an index page query (strings and integers)."""
    return [value.encode("utf-8") if type(value) is str else str(value).encode("ascii") for value in values]


def _index_rows(result: Any) -> Iterator[tuple[str, str]]:
    value = result.get_value
    for row in range(result.ntuples):
        yield value(row, 0).decode("utf-8"), value(row, 1).decode("utf-8")


def _query_params(query: StorageQuery, *, exclusive: bool, hold_space: int) -> tuple[tuple[bool, ...], list[Any]]:
    """The ``_query_sql`` shape of ``query`` and its parameters, in the statement's order."""
    bounds = query.range
    name = query.index.value
    partition = query.encoded_partition
    present = [bound for bound in (bounds.gt, bounds.gte, bounds.lt, bounds.lte) if bound is not None]
    params: list[Any] = [name, partition, *present]
    after = decode_storage_query_cursor(query)
    if after is not None:
        params.extend((after.sort, after.key))
    keyed = key_ordered_range(name, partition)
    shape = (
        bounds.gt is not None,
        bounds.gte is not None,
        bounds.lt is not None,
        bounds.lte is not None,
        after is not None,
        query.direction is SortDirection.DESC,
        exclusive,
        keyed is not None,
    )
    page = query.limit + 1  # one more than the page: whether another page follows
    if keyed is not None:
        prefix, start = keyed.prefix, keyed.start
        params.append(prefix)
        if not exclusive:
            params.append(page)
        params.extend((start, prefix, keyed.upper))
        params.extend(prefix + bound for bound in present)
        if after is not None:
            params.extend((prefix + after.sort, start, after.sort, after.key))
        params.extend((f" {name},{partition},", start))
        if not exclusive:
            params.append(page)
    params.extend((hold_space, query.limit) if exclusive else (page,))
    return shape, params


# ---------------------------------------------------------------------------------------------
# Transaction attempts


_IDLE = TransactionStatus.IDLE
_CONNECTION_OK = ConnStatus.OK


# A btree index entry holds at most 2,704 bytes (a third of a page), so Postgres refuses a commit whose
# record key or index row is longer. Such a write is refused when it is staged, before the commit, as a
# storage limit (``validation_failed``; core turns an attempt's outcome into a failure) instead of an
# ``internal_error`` after the callback's work: ids and keys of a few hundred characters each can add up.
MAX_INDEX_ENTRY_BYTES = 2704


def _index_entry_bytes(*columns: str) -> int:
    """The size of a btree entry of ASCII text ``columns`` (keys and tuple encodings are hexadecimal):
    an 8-byte tuple header, then each value with its 4-byte length, aligned to 4 bytes."""
    return 8 + sum((4 + len(column) + 3) & ~3 for column in columns)


def _largest_index_entry(key: StorageRecordKey, record: NewStorageRecord | None) -> int:
    """The largest btree entry a write of ``record`` at ``key`` adds (its key, its index rows)."""
    encoded = key.encoded
    largest = _index_entry_bytes(encoded)
    if record is not None:
        for entry in record.indexes:
            name, partition, sort = entry.name._value_, entry.encoded_partition, entry.encoded_sort
            if not repeats_key(name, partition, sort, encoded):
                largest = max(largest, _index_entry_bytes(name, partition, sort, encoded))
    return largest


class _PostgresAttempt(StorageAttempt):
    """One attempt of a transaction callback on one pooled connection; see the module docstring."""

    def __init__(self, driver: PostgresStorageDriver, clock: Clock) -> None:
        super().__init__(driver.profile.limits, clock)
        self._driver = driver
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._in_transaction = False  # an explicit transaction holds exclusive candidates
        self._statements = 0  # read statements run (one statement is one consistent snapshot)
        self._fetched: dict[str, StorageRecord] = {}  # what reads returned, by encoded key
        # Records an exclusive scan returned with its candidates (None: absent), by encoded key.
        self._prefetched: dict[str, StorageRecord | None] = {}
        self._hints: set[str] = set()  # queues whose wake hint goes out with this attempt's commit
        self._keys: dict[str, StorageRecordKey] = {}  # every key read or written, by encoded key
        self._broken = False
        # The commit's advisory locks (key -> shared): point keys, then stream heads (set by _commit_payload).
        self._locks: tuple[dict[int, bool], dict[int, bool]] = ({}, {})
        # A read hit a supported conflict or lost its connection (remembered even if the callback
        # swallowed the exception): the attempt cannot commit and is replayed.
        self._replay = False
        self.lost_connection: RunlaneError | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None:
            self._conn = await self._driver._acquire()
        return self._conn

    def _stage(self, write: StagedWrite) -> None:
        key, _, record = write
        size = _largest_index_entry(key, record)
        if size > MAX_INDEX_ENTRY_BYTES:
            self._fail(
                StorageLimitError(
                    INDEX_ENTRY_LIMIT,
                    MAX_INDEX_ENTRY_BYTES,
                    size,
                    f"Postgres cannot index the ids and keys of this {key.collection} record: they need an index "
                    f"entry of {size:,} bytes, over its limit of {MAX_INDEX_ENTRY_BYTES:,}. Nothing was written; "
                    "use shorter ids and keys (hash long values).",
                )
            )
        super()._stage(write)

    def _failed(self, error: BaseException, doing: str, *, committing: bool = False) -> RunlaneError | _Replay:
        """The exception for a failed statement: ``_Replay`` when replaying the callback is safe."""
        if _is_disconnect(error):
            self._broken = True
            if committing:
                detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                return RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"Lost the Postgres connection while committing; the transaction's outcome is unknown ({detail}): "
                    "it may have been committed, so check before repeating what must not happen twice (a trigger "
                    "with an idempotency key can simply be repeated).",
                    retryable=True,
                    meta={"sqlstate": _sqlstate(error)} if _sqlstate(error) else {},
                    cause=error,
                )
            self.lost_connection = map_postgres_error(error, doing)
            self._replay = True
            return _Replay()
        if _is_conflict(error):
            self._replay = True
            return _Replay()
        if _sqlstate(error) == "25006":
            # The session refuses writes (it began read-only: a standby, or default_transaction_read_only of
            # the role or database), and keeps refusing them: drop it, so a retry opens a new session, which
            # reaches a primary or a role that writes again.
            self._broken = True
        return map_postgres_error(error, doing)

    # -- reads -----------------------------------------------------------------------------------

    async def _fetch(self, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        if not keys:
            return []
        wanted = {key.encoded: key for key in keys}
        self._keys.update(wanted)
        prefetched = self._prefetched
        if prefetched and all(encoded in prefetched for encoded in wanted):
            # Read by the exclusive scan that returned them, in this transaction: no round trip.
            found = {encoded: record for encoded in wanted if (record := prefetched[encoded]) is not None}
            self._fetched.update(found)
            return [found.get(key.encoded) for key in keys]
        conn = await self._connection()
        try:
            result = await _call(conn, self._driver._sql.get, (_key_array(wanted),))
        except psycopg.Error as error:
            raise self._failed(error, "read records") from error
        self._statements += 1
        found = _found_records(wanted, result, self._driver._written)
        self._fetched.update(found)
        return [found.get(key.encoded) for key in keys]

    async def _candidates(self, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        conn = await self._connection()
        exclusive = mode is StorageCandidateMode.EXCLUSIVE
        shape, params = _query_params(query, exclusive=exclusive, hold_space=self._driver._hold_space)
        try:
            statement = _query_statement(self._driver._sql.index_rows, shape)
            if exclusive and not self._in_transaction:
                # BEGIN and the first query in one round trip; the holds last until the attempt ends.
                self._in_transaction = True
                (_, result) = await _call_all(conn, [(b"BEGIN", ()), (statement, _encode_params(params))])
            else:
                result = await _call(conn, statement, _encode_params(params))
            rows = list(_index_rows(result))
        except psycopg.Error as error:
            raise self._failed(error, "query index candidates") from error
        self._statements += 1
        page = page_index_rows(query, iter(rows), look_ahead=not exclusive)
        if exclusive:
            self._prefetch(page, result)
        return page

    def _prefetch(self, page: StorageQueryResult, result: Any) -> None:
        """Keep the records an exclusive scan returned beside its candidates, for the reads that follow."""
        keys = {item.key.encoded: item.key for item in page.items}
        value = result.get_value
        written = self._driver._written
        for row in range(result.ntuples):
            encoded = value(row, 1).decode("utf-8")
            key = keys.get(encoded)
            if key is None:
                continue
            version = value(row, 2)
            if version is None:
                self._prefetched[encoded] = None
                continue
            try:
                found = _record(key, int(version), _text(value(row, 3)), _text(value(row, 4)), written)
            except RunlaneError:
                # A corrupt record fails the read of it, not the scan: the caller learns which record it is
                # (and a worker sets that run aside) instead of every scan over it failing.
                continue
            self._prefetched[encoded] = found

    # -- wake hints ------------------------------------------------------------------------------

    def wake_hint(self, queue: str) -> bool:
        """Send a wake hint for ``queue`` with this attempt's commit (``NOTIFY`` inside it, so idle
        workers hear of the run when it commits, with no statement of its own). ``False`` when a
        hint for the queue went out within ``wake_hint_interval``: the debounced path sends it."""
        driver = self._driver
        if type(queue) is not str or driver._pool is None or not driver._hint_due(queue):
            return False
        self._hints.add(queue)
        return True

    # -- commit ----------------------------------------------------------------------------------

    async def _commit(self) -> bool:
        """Commit the staged work; ``False`` when a supported conflict rolled it back (replay)."""
        self.check_committable()
        if self._replay:
            return False
        if not self.has_mutations:
            return await self._finish_read_only()
        carried = self._driver._take_due_hints()  # held-back hints of earlier triggers ride along
        self._hints |= carried
        try:
            committed = await self._commit_staged()
        except BaseException:
            self._driver._hold_back(carried)
            raise
        if not committed:
            self._driver._hold_back(carried)
        return committed

    async def _commit_staged(self) -> bool:
        payload = self._commit_payload()
        append = self.append_command
        conn = await self._connection()
        try:
            if self._in_transaction:
                result, _ = await _call_all(conn, [(self._driver._sql.commit_prepared, (payload,)), (b"COMMIT", ())])
                self._in_transaction = False
                status = int(result.get_value(0, 0))
            else:
                local = self._driver._loops.get(asyncio.get_running_loop())
                if local is None:  # closed since this attempt took its connection
                    raise self._driver._not_started()
                status = await self._driver._group_commit(local, conn, payload, self._locks)
        except psycopg.Error as error:
            state = _sqlstate(error)
            if append is not None and state in _APPEND_FAILURES:
                detail = error.detail if isinstance(error, _AttemptFailed) else error.diag.message_detail
                raise _append_failure(append, state, detail) from error
            failure = self._failed(error, "commit the transaction", committing=True)
            if isinstance(failure, _Replay):
                return False
            raise failure from error
        if status != 0:
            return False  # 1: a dependency changed, nothing was written
        self._driver._written.remember(self.writes)
        if self._hints:
            self._driver._hinted(self._hints)
        return True

    async def _finish_read_only(self) -> bool:
        """A read-only attempt is consistent when its reads were one snapshot, or still hold now."""
        if self._conn is None:
            return True
        reads = self.reads if self._statements > 1 else {}
        if not reads and not self._in_transaction:
            return True
        conn = self._conn
        versions = [None if version is None else int(version) for version in reads.values()]
        try:
            changed = 0
            validate: list[tuple[_Statement | bytes, Sequence[bytes | None]]] = []
            if reads:
                literal = "{" + ",".join("NULL" if version is None else str(version) for version in versions) + "}"
                validate.append((self._driver._sql.validate, (_key_array(reads), literal.encode("ascii"))))
            if self._in_transaction:
                answers = await _call_all(conn, [*validate, (b"ROLLBACK", ())])
                self._in_transaction = False
                if reads:
                    changed = int(answers[0].get_value(0, 0))
            elif reads:
                # The only entry: the validate statement appended above.
                result = await _call(conn, *cast("tuple[_Statement, Sequence[bytes | None]]", validate[0]))
                changed = int(result.get_value(0, 0))
        except psycopg.Error as error:
            failure = self._failed(error, "validate the transaction's reads")
            if isinstance(failure, _Replay):
                return False
            raise failure from error
        return changed == 0

    def _commit_payload(self) -> bytes:
        """The ``runlane_commit`` document of this attempt (see the migration for its members)."""
        writes = self.writes
        append = self.append_command
        dependencies: dict[str, str | None] = dict(self.reads)
        written: set[str] = set()
        payload: dict[str, Any] = {}
        deletes: list[str] = []
        creates: list[tuple[str, str, int, str]] = []
        replaces: list[tuple[str, str, int, str]] = []
        unindex: list[tuple[str, str, str, str]] = []
        index: list[tuple[str, str, str, str]] = []
        unrun: list[tuple[str, ...]] = []
        runs: list[tuple[Any, ...]] = []
        unevent: list[tuple[str, ...]] = []
        events: list[tuple[Any, ...]] = []
        fetched = self._fetched
        for key, expected, record in writes:
            encoded = key.encoded
            written.add(encoded)
            self._keys[encoded] = key
            if encoded not in dependencies:
                dependencies[encoded] = expected  # a blind create: the key must still be absent
            old_rows: Iterable[StorageIndexEntry] = ()
            if expected is not None:
                current = fetched.get(encoded)
                if current is None or current.version != expected:  # pragma: no cover - StorageAttempt checks
                    raise contract_violation(f"{key!r} was not read at version {expected} in this attempt.")
                old_rows = current.indexes
            if record is None:
                deletes.append(encoded)
                new_rows: Iterable[StorageIndexEntry] = ()
            else:
                document = record.document
                new_rows = record.indexes
                stored = (encoded, document.text, document.byte_size, _encode_entries(new_rows))
                (creates if expected is None else replaces).append(stored)
            if old_rows or new_rows:
                # Entries that restate the key have no row: the key range of the records serves them.
                old = {(e.name._value_, e.encoded_partition, e.encoded_sort) for e in old_rows}
                new = {(e.name._value_, e.encoded_partition, e.encoded_sort) for e in new_rows}
                unindex.extend(
                    (name, partition, sort, encoded)
                    for name, partition, sort in old - new
                    if not repeats_key(name, partition, sort, encoded)
                )
                index.extend(
                    (name, partition, sort, encoded)
                    for name, partition, sort in new - old
                    if not repeats_key(name, partition, sort, encoded)
                )
            if is_operator_run_key(key):
                row = None if record is None else operator_run_row(key, record.document)
                if row is not None:
                    runs.append(row)
                elif expected is not None:
                    unrun.append(key.parts)
            elif is_operator_event_key(key):
                row = None if record is None else operator_event_row(key, record.document)
                if row is not None:
                    events.append(row)
                elif expected is not None:
                    unevent.append(key.parts)

        salt = self._driver._lock_salt
        locks: dict[int, bool] = {}  # advisory lock key -> shared, for keys other than stream heads
        head_locks: dict[int, bool] = {}  # stream heads read or written as records: locked after the others
        keys = self._keys
        for encoded in dependencies:
            target = head_locks if keys[encoded].collection in _HEAD_COLLECTIONS else locks
            lock = _lock_hash(salt, encoded)
            target[lock] = target.get(lock, True) and encoded not in written
        if append is not None:
            layout = storage_stream_layouts[append.stream]
            head = layout.head_key(append.partition).encoded
            head_lock = _lock_hash(salt, head)
            payload["a"] = {
                "h": head,
                "l": head_lock,
                "n": layout.index.value,
                "p": encode_storage_tuple((append.partition,)),
                "k": encode_storage_tuple((layout.record_collection, append.partition)) + "/",
                "v": _split_append(append),
            }
            self._locks = (locks, {**head_locks, head_lock: False})  # a batch locks every head up front
            if head_locks:  # other heads are locked up front: keep one global order among heads
                head_locks[head_lock] = False
        else:
            self._locks = (locks, head_locks)
        ordered = [(lock, locks[lock]) for lock in sorted(locks)]
        ordered += [(lock, head_locks[lock]) for lock in sorted(head_locks)]
        if ordered:
            payload["l"] = ordered
        if self._hints:
            payload["n"] = (self._driver._channel, sorted(self._hints))
        if dependencies:
            payload["d"] = [
                (encoded, None if version is None else int(version)) for encoded, version in dependencies.items()
            ]
        for name, rows in (
            ("x", deletes),
            ("c", creates),
            ("p", replaces),
            ("u", unindex),
            ("i", index),
            ("ur", unrun),
            ("r", runs),
            ("ue", unevent),
            ("e", events),
        ):
            if rows:
                payload[name] = rows
        return orjson.dumps(payload)

    async def _release(self) -> None:
        """End of the attempt: roll back anything open and hand the connection back (never raises)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not self._broken and conn.info.transaction_status != _IDLE:
                await conn.execute(b"ROLLBACK")
        except BaseException:  # noqa: BLE001 - the connection is discarded below
            self._broken = True
        self._in_transaction = False
        await self._driver._return(conn, broken=self._broken)


class _AttemptFailed(psycopg.DatabaseError):
    """The error one attempt of a commit batch raised (the batch rolled back only that attempt)."""

    def __init__(self, sqlstate: str | None, message: str, detail: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.detail = detail


@dataclass(slots=True)
class _Waiting:
    """An attempt waiting for the commit batch in flight to end: then it is answered, or it leads
    the next batch (``lead``) on its own connection."""

    payload: bytes
    locks: tuple[dict[int, bool], dict[int, bool]]
    future: asyncio.Future[Any]


_LEAD = object()


@dataclass(slots=True)
class _LoopState:
    """What a driver keeps per event loop that uses it: a pool of its own (a psycopg pool, its
    connections and their waiters belong to the loop that opened them) and the group commit."""

    loop: asyncio.AbstractEventLoop
    pool: AsyncConnectionPool
    committing: bool = False
    commit_queue: list[_Waiting] = field(default_factory=list)
    check: asyncio.Future[None] | None = None  # a pool check in flight (see ``_recover``)


def _hand_off(state: _LoopState) -> None:
    """Hand a loop's commit queue to its first live attempt, which commits it on its own connection."""
    while state.commit_queue:
        waiting = state.commit_queue.pop(0)
        if not waiting.future.done():
            state.committing = True
            waiting.future.set_result(_LEAD)
            return


#: The most attempts one commit batch carries.
MAX_COMMIT_BATCH = 64


_APPEND_FAILURES = frozenset({"RL002", "RL003", "RL004"})
_HEAD_COLLECTIONS = frozenset(layout.head_collection for layout in storage_stream_layouts.values())


def _append_failure(command: StorageAppendCommand, state: str | None, detail: str | None) -> RunlaneError:
    """The error of an append the commit function refused (it rolled back: nothing was written)."""
    layout = storage_stream_layouts[command.stream]
    head_key = layout.head_key(command.partition)
    if state == "RL004":
        return RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The {command.stream.value} stream already holds records past its head; refusing to overwrite them.",
        )
    try:
        head = StorageRecord(head_key, "1", StorageDocument.parse(detail)) if detail else None
        start = read_storage_stream_position(head)
        materialize_storage_append(command, start)
    except RunlaneError as error:
        return error
    return RunlaneError(  # the head is valid JSON but not in the canonical form the layout writes
        ErrorCode.INVARIANT_VIOLATION,
        f"The {command.stream.value} stream head is not in its canonical form; refusing to allocate positions.",
    )


# ---------------------------------------------------------------------------------------------
# The driver


class PostgresStorageDriver(ClientClock):
    """Postgres ``StorageDriver`` and ``OperatorReadDriver``; see the module docstring."""

    def __init__(
        self,
        connection_string: str,
        *,
        schema: str | None = None,
        min_size: int = 1,
        max_size: int = 10,
        clock: Clock | None = None,
        limits: StorageLimits | None = None,
        max_transaction_attempts: int = 16,
        name: str = "postgres-storage",
        connect_timeout: float = 10.0,
        statement_timeout: float | None = 30.0,
        pool_timeout: float = 30.0,
    ) -> None:
        self._target = resolve_postgres_connection(connection_string, schema)
        for option, value in (("min_size", min_size), ("max_size", max_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if option == "min_size" else 1):
                raise _invalid(f"{option} must be a {'non-negative' if option == 'min_size' else 'positive'} integer.")
        if min_size > max_size:
            raise _invalid("min_size must not exceed max_size.")
        if clock is not None:
            checked_clock(clock)
        if limits is not None and not isinstance(limits, StorageLimits):
            raise _invalid("limits must be a StorageLimits value.")
        attempts = max_transaction_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise _invalid("max_transaction_attempts must be a positive integer.")
        if not isinstance(name, str) or not name:
            raise _invalid("name must be a non-empty string.")
        check_seconds("connect_timeout", connect_timeout)
        check_seconds("pool_timeout", pool_timeout)
        if statement_timeout is not None and (
            isinstance(statement_timeout, bool)
            or not isinstance(statement_timeout, (int, float))
            or not 0 < statement_timeout < math.inf
        ):
            raise _invalid("statement_timeout must be a positive number of seconds or None.")
        self.name = name
        self.schema = self._target.schema
        self.profile = StorageProfile(
            durability=StorageDurability.DURABLE,
            clock_authority=StorageClockAuthority.CLIENT,
            index_consistency=StorageIndexConsistency.STRONG,
            limits=limits or StorageLimits(),
            exclusive_candidates=True,
            ordered_append=True,
            process_local=False,
        )
        self.max_transaction_attempts = attempts
        self.min_size = min_size
        self.max_size = max_size
        self.connect_timeout = float(connect_timeout)
        self.statement_timeout = None if statement_timeout is None else float(statement_timeout)
        self.pool_timeout = float(pool_timeout)
        self._clock: Clock = clock or SystemClock()
        self._sql = _Sql.for_schema(self.schema)
        salt = hashlib.blake2b(self.schema.encode("utf-8"), digest_size=16).digest()
        self._lock_salt = salt
        # Exclusive holds use the two-integer advisory key space (disjoint from commit locks), with the
        # schema's own first integer so two Runlane schemas in one database never share holds.
        self._hold_space = int.from_bytes(salt[:4], "big", signed=True)
        # The pool of the loop that started the driver; ``None`` before start() and after close().
        self._pool: AsyncConnectionPool | None = None
        # Every loop's pool and group commit, the starting loop's included: ``runlane.sync`` calls
        # from a loop of its own while an application loop serves the same runtime, so a driver
        # may be used from several loops (threads) at once.
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._loops_lock = threading.Lock()
        self._pid = 0  # the process that started the driver: a forked child must start one of its own
        self._lock = asyncio.Lock()
        self._unreachable = False  # a fresh connection failed at the last look
        # Wake hints (LISTEN / NOTIFY on one channel per schema).
        self._channel = f"runlane_wake_{hashlib.blake2b(self.schema.encode('utf-8'), digest_size=8).hexdigest()}"
        self._hints_pending: set[str] = set()
        self._hinted_at: dict[str, float] = {}  # queue -> monotonic time its last hint went out
        self._hints_task: asyncio.Task[None] | None = None
        self._hints_conn: psycopg.AsyncConnection[Any] | None = None
        # Documents this driver replaced, recognized when read back.
        self._written = WrittenDocuments()
        self._subscribers: dict[object, Callable[[str], None]] = {}
        self._listener: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"PostgresStorageDriver(name={self.name!r}, target={self._target.display!r}, schema={self.schema!r})"

    @property
    def connection_string(self) -> str:
        """The connection string this driver connects with, ``?schema=`` removed (it may hold a password)."""
        return self._target.conninfo

    # -- lifecycle -------------------------------------------------------------------------------

    def _connect_kwargs(self) -> dict[str, Any]:
        # prepare_threshold=None: psycopg never prepares statements on its own. When it has, it answers
        # a ROLLBACK with DEALLOCATE ALL, which would also drop the statements ``_call`` prepared.
        return {
            "autocommit": True,
            "prepare_threshold": None,
            **self._target.connection_defaults(connect_timeout=self.connect_timeout),
        }

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Documents come back as their exact text, never parsed by psycopg.
        for type_name in ("json", "jsonb"):
            conn.adapters.register_loader(type_name, TextLoader)
            conn.adapters.register_loader(type_name, TextBinaryLoader)
        # Statements run through libpq directly (``_call``) send and read UTF-8 text, and psycopg reads a
        # timestamp (the server's clock, at start) only in the ISO date style, whatever the database sets.
        settings = [
            "SET client_encoding = 'UTF8'",
            "SET DateStyle = 'ISO'",
            "SET idle_in_transaction_session_timeout = '60s'",
        ]
        if self.statement_timeout is not None:
            settings.append(f"SET statement_timeout = '{round(self.statement_timeout * 1000)}ms'")
            # The server ends a statement at statement_timeout; one it does not answer at all by a while
            # after that never will (see ``_ready``).
            _ANSWER_WITHIN[conn] = self.statement_timeout + _ANSWER_MARGIN_S
        await _answered(conn, conn.execute("; ".join(settings).encode("ascii")))

    async def start(self) -> None:
        """Open the pool after probing that the database is reachable and migrated (no auto-migration)."""
        async with self._lock:
            if self._pool is not None:
                return
            await self._probe()
            self._unreachable = False
            pool = self._new_pool(self.min_size)
            try:
                await pool.open(wait=self.min_size > 0, timeout=self.connect_timeout)
            except Exception as error:  # noqa: BLE001 - mapped
                await pool.close()
                doing = f"open the connection pool of {self._target.display}"
                if not isinstance(error, PoolTimeout):
                    raise map_postgres_error(error, doing) from error
                raise RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"Could not {doing}: its min_size of {self.min_size} connections did not all open within "
                    f"connect_timeout ({error}); the server may have no connection slot left or be slow to accept "
                    "connections. Retry, and when this recurs lower min_size, or raise connect_timeout or the "
                    "server's max_connections.",
                    retryable=True,
                    cause=error,
                ) from error
            loop = asyncio.get_running_loop()
            with self._loops_lock:
                self._loops[loop] = _LoopState(loop, pool)
                self._pool = pool
                self._pid = os.getpid()

    def _new_pool(self, min_size: int) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            self._target.conninfo,
            min_size=min_size,
            max_size=self.max_size,
            kwargs=self._connect_kwargs(),
            configure=self._configure,
            timeout=self.pool_timeout,
            name=self.name,
            open=False,
        )

    async def _local(self) -> _LoopState:
        """The running loop's pool and group commit. A loop other than the starting one gets a pool
        of its own on first use, which keeps no connections open up front."""
        if self._pid != os.getpid():
            raise self._forked()
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            with self._loops_lock:
                if self._pool is None:
                    raise self._not_started()
                state = self._loops.get(loop)
                if state is None:
                    for gone in [other for other in self._loops if other.is_closed()]:
                        del self._loops[gone]  # nothing runs there any more; its connections go with it
                    state = self._loops[loop] = _LoopState(loop, self._new_pool(0))
            try:
                await state.pool.open()  # idempotent
            except Exception as error:  # noqa: BLE001 - mapped
                raise map_postgres_error(error, f"open a connection pool of {self._target.display}") from error
        return state

    def _forked(self) -> RunlaneError:
        # The inherited connections belong to the parent: one byte sent on them here would corrupt
        # the parent's sessions.
        return RunlaneError(
            ErrorCode.STORAGE_UNAVAILABLE,
            f"Storage driver {self.name!r} was started in process {self._pid}; a forked process must "
            "create and start a driver of its own.",
        )

    def _not_started(self) -> RunlaneError:
        return RunlaneError(
            ErrorCode.STORAGE_UNAVAILABLE,
            f"Storage driver {self.name!r} is not started (or closed).",
            retryable=True,
        )

    async def _probe(self) -> None:
        doing = f"connect to Postgres at {self._target.display}"
        try:
            conn = await psycopg.AsyncConnection.connect(self._target.conninfo, **self._connect_kwargs())
        except Exception as error:  # noqa: BLE001 - mapped
            raise map_postgres_error(error, doing) from error
        try:
            async with conn:
                # The settings of a pooled connection: the probe waits for a lock, or for a server that
                # stopped answering, no longer than any other statement would.
                await self._configure(conn)
                await _answered(conn, self._check_schema(conn))
        except RunlaneError:
            raise
        except Exception as error:  # noqa: BLE001 - mapped
            raise map_postgres_error(error, f"probe the Runlane schema {self.schema!r}") from error

    async def _check_schema(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The probe's checks: no pooler sharing sessions, a UTF8 database, the schema migrated to this driver's
        version, the clocks."""
        await self._refuse_shared_sessions(conn)
        cursor = await conn.execute("SHOW server_encoding")
        (encoding,) = await cursor.fetchone()  # type: ignore[misc]
        refused = encoding_error(encoding, self._target.display)
        if refused is not None:
            raise refused
        objects = self._sql.schema_objects()
        cursor = await conn.execute(
            "SELECT array(SELECT o FROM unnest(%s::text[]) AS o WHERE to_regclass(o) IS NULL), "
            "array(SELECT f FROM unnest(%s::text[]) AS f WHERE to_regprocedure(f) IS NULL)",
            objects,
        )
        missing_relations, missing_functions = await cursor.fetchone()  # type: ignore[misc]
        if self._sql.migrations in missing_relations or self._sql.records in missing_relations:
            raise await self._unmigrated(conn)
        cursor = await conn.execute(ledger_query(self._sql.migrations))
        (version, needs) = await cursor.fetchone()  # type: ignore[misc]
        if needs > SCHEMA_VERSION:
            raise newer_schema_error(self.schema, self._target.display, int(version), migrating=False)
        if version < SCHEMA_VERSION:
            found = (
                "records no applied version (a migration that did not finish)"
                if version == 0
                else f"is at version {version}"
            )
            raise _invalid(
                f"The Runlane schema {self.schema!r} in {self._target.display} {found}, this driver needs "
                f"{SCHEMA_VERSION}; {MIGRATE_HINT} the lane.",
                schema=self.schema,
            )
        missing = [name.rsplit(".", 1)[1] for name in [*missing_relations, *missing_functions]]
        if missing:
            # Dropped by hand (or by a tool other than Runlane): every commit would fail on them.
            lost = (
                "; the rows of a dropped table are not brought back: restore them from a backup when it held any"
                if any(not name.endswith(".runlane_record_versions") for name in missing_relations)
                else ""
            )
            raise _invalid(
                f"The Runlane schema {self.schema!r} in {self._target.display} is at version {version} but lacks "
                f"{', '.join(missing)}: something other than Runlane dropped {'it' if len(missing) == 1 else 'them'}. "
                f"Run `runlane postgres migrate` (or apply postgres_migration_sql()) to create what is missing before "
                f"starting the lane{lost}.",
                schema=self.schema,
                missing=missing,
            )
        await self._compare_clocks(conn)

    async def _unmigrated(self, conn: psycopg.AsyncConnection[Any]) -> RunlaneError:
        """``configuration_invalid`` for a schema without Runlane's tables, naming the schemas of the database
        that have them: a lane whose schema is misspelt, or not set, should not be told to migrate an empty one."""
        cursor = await conn.execute(OTHER_SCHEMAS_QUERY, (self.schema,))
        (others,) = await cursor.fetchone()  # type: ignore[misc]
        where = f"The Runlane schema {self.schema!r} is not migrated in {self._target.display}"
        if not others:
            return _invalid(f"{where}; {MIGRATE_HINT} the lane.", schema=self.schema)
        likeliest = likeliest_schemas(others, self.schema)
        shown = ", ".join(repr(name) for name in likeliest) + (", ..." if len(others) > len(likeliest) else "")
        holds = f"the Runlane schema {shown}" if len(others) == 1 else f"the Runlane schemas {shown}"
        return _invalid(
            f"{where}, which holds {holds}: when the lane should use "
            f"{'it' if len(others) == 1 else 'one of them'}, set the lane's schema (its schema option, or "
            f"?schema= in its connection string; the name keeps its case); otherwise {MIGRATE_HINT} the lane.",
            schema=self.schema,
            runlane_schemas=likeliest,
        )

    async def _refuse_shared_sessions(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Refuse a pooler in transaction or statement mode (``configuration_invalid``), whose clients take
        turns on server sessions. A connection whose server process is not the one it connected to goes
        through a pooler; then a second connection opens a transaction: handed the server process the first
        connection used (still connected, so in session mode no other client could have it), the pooler
        shares sessions. Otherwise (session mode, or a pooler that handed it another process) it starts."""
        cursor = await conn.execute("SELECT pg_backend_pid()")
        (backend,) = await cursor.fetchone()  # type: ignore[misc]
        if backend == conn.pgconn.backend_pid:
            return  # connected to the server itself
        try:
            async with asyncio.timeout(self.connect_timeout):
                other = await psycopg.AsyncConnection.connect(self._target.conninfo, **self._connect_kwargs())
                async with other, other.transaction():
                    cursor = await other.execute("SELECT pg_backend_pid()")
                    (shared,) = await cursor.fetchone()  # type: ignore[misc]
        except (TimeoutError, psycopg.Error):
            return  # no second session in time: the pool's own connections will tell
        if shared == backend:
            raise _invalid(
                f"The connection to {self._target.display} goes through a pooler that shares server sessions "
                f"between clients (transaction or statement pooling): two connections of this process ran on "
                f"one server process ({backend}). {SESSION_POOLING_HINT}.",
                backend_pid=backend,
            )

    async def _compare_clocks(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Warn when this process's clock is off the server's by ``CLOCK_SKEW_WARNING_S`` or more. Every
        process reads its own clock for leases and due times, so processes whose clocks disagree take
        runs from each other's live attempts (docs/lanes.md, "Clocks"); the server is the one clock they
        all reach. A test's ``ControlledClock`` is not compared: its time is wherever the test set it, and
        the warning's advice (synchronize this machine's clock) would be wrong."""
        from runlane.testing.clock import ControlledClock

        if isinstance(self._clock, ControlledClock):
            return
        sent = self._clock.now()
        cursor = await conn.execute("SELECT clock_timestamp()")
        (server,) = await cursor.fetchone()  # type: ignore[misc]
        received = self._clock.now()
        offset = (sent + (received - sent) / 2 - server).total_seconds()
        if abs(offset) >= CLOCK_SKEW_WARNING_S:
            _clock_log.warning(
                "This process's clock is %.1f s %s the Postgres server's at %s. Each Runlane process reads "
                "its own clock for leases and due times, so clocks that disagree by more than a lease's "
                "heartbeat margin run handlers twice (see 'Clocks' in docs/lanes.md): synchronize this "
                "machine's clock (NTP).",
                abs(offset), "ahead of" if offset > 0 else "behind", self._target.display,
                extra={"clock_offset_seconds": offset},
            )  # fmt: skip

    async def close(self) -> None:
        sender = self._hints_task
        if sender is not None and not sender.done() and sender.get_loop() is asyncio.get_running_loop():
            # Hints still held back (a cancellation requested just before close, by `runlane cancel`
            # for instance) go out first; a database that does not answer only delays close by this.
            with contextlib.suppress(Exception):  # hints may be lost: workers still heartbeat and poll
                await asyncio.wait_for(asyncio.shield(sender), _HINT_FLUSH_TIMEOUT_S)
        async with self._lock:
            with self._loops_lock:
                self._pool = None
                states = list(self._loops.values())
                self._loops.clear()
            if self._pid != os.getpid():  # a forked child: what it inherited is the parent's to close
                self._hints_task = self._listener = self._hints_conn = None
                self._hints_pending.clear()
                return
            current = asyncio.get_running_loop()
            for task in (self._hints_task, self._listener):
                if task is None or task.done():
                    continue
                if task.get_loop() is current:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                elif task.get_loop().is_running():  # another live loop's: cancelled there
                    with contextlib.suppress(RuntimeError):
                        task.get_loop().call_soon_threadsafe(task.cancel)
                # else its loop stopped: the task can never run again
            self._hints_task = self._listener = None
            self._hints_pending.clear()
            hints_conn, self._hints_conn = self._hints_conn, None
            if hints_conn is not None:
                with contextlib.suppress(Exception):
                    await hints_conn.close()
            for state in states:
                await self._close_pool(state, current)

    async def _close_pool(self, state: _LoopState, current: asyncio.AbstractEventLoop) -> None:
        """Close one loop's pool, on that loop (a pool's tasks and waiters belong to it)."""
        if state.loop is current:
            await state.pool.close(timeout=self.connect_timeout)
            return
        if not state.loop.is_running():
            return  # nothing can run on that loop any more; its connections close when collected
        try:
            closing = asyncio.run_coroutine_threadsafe(state.pool.close(timeout=self.connect_timeout), state.loop)
        except RuntimeError:
            return  # closed meanwhile
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(closing), self.connect_timeout * 2)

    # -- wake hints (StorageWakeHints) -----------------------------------------------------------

    #: Minimum seconds between two hints of one driver for one queue; hints in between are merged.
    #: Short, because a hint held back is latency for a worker that has just gone idle; long enough
    #: that a busy producer sends at most a few hundred hints a second per queue.
    wake_hint_interval: float = 0.002

    def publish_wake_hint(self, queue: str) -> None:
        """Schedule ``NOTIFY`` of ``queue`` on this schema's channel; returns at once, never raises.

        The first hint goes out at once; hints arriving within ``wake_hint_interval`` after it are
        held back, then carried by the next commit of this driver, or merged into one statement
        when no commit comes within another interval.
        """
        try:
            if self._pool is None or not isinstance(queue, str) or self._pid != os.getpid():
                return
            self._hold_back((queue,))
        except Exception:  # noqa: BLE001 - hints may be lost; workers still poll
            pass

    def _hold_back(self, queues: Iterable[str]) -> None:
        """Keep hints for the next commit that is due to carry them, or else ``_send_hints``."""
        if not queues:
            return
        self._hints_pending.update(queues)
        sender = self._hints_task
        # A sender on a loop that stopped or closed with it pending never sends: start one here.
        if sender is None or sender.done() or not sender.get_loop().is_running():
            self._hints_task = asyncio.get_running_loop().create_task(self._send_hints())

    def _take_due_hints(self) -> set[str]:
        """The held-back hints whose interval has passed, for a commit to carry (``NOTIFY`` in the
        commit): while commits keep coming, held-back hints need no statement of their own."""
        if not self._hints_pending:
            return set()
        due = {queue for queue in self._hints_pending if self._hint_due(queue)}
        self._hints_pending -= due
        return due

    def _hint_due(self, queue: str) -> bool:
        last = self._hinted_at.get(queue)
        return last is None or time.monotonic() - last >= self.wake_hint_interval

    def _hinted(self, queues: Iterable[str]) -> None:
        now = time.monotonic()
        hinted_at = self._hinted_at
        for queue in queues:
            hinted_at[queue] = now
        if len(hinted_at) > _MAX_REMEMBERED_HINTS:
            # Hints are per queue, and also per run for cancellations: forget the ones past their
            # interval, which is all the debounce needs, so the table does not grow with the runs.
            for hint in [hint for hint, at in hinted_at.items() if now - at >= self.wake_hint_interval]:
                del hinted_at[hint]

    async def _send_hints(self) -> None:
        # One connection of its own (outside the pool): a hint never waits for, or holds, a
        # connection that transaction attempts need.
        while self._hints_pending and self._pool is not None:
            # A queue hinted within the interval waits out the rest, and one interval more for a
            # commit of this driver to carry the hint (``_take_due_hints``); only then a statement.
            last = max((self._hinted_at.get(queue, 0.0) for queue in self._hints_pending), default=0.0)
            wait = 2 * self.wake_hint_interval - (time.monotonic() - last)
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._hints_pending:
                break
            queues = sorted(self._hints_pending)
            self._hints_pending.clear()
            self._hinted(queues)
            if not await self._notify((self._channel.encode("ascii"), _text_array(queues))):
                return  # hints may be lost: workers still poll and heartbeat; the next hint reconnects
            await asyncio.sleep(self.wake_hint_interval)

    async def _notify(self, params: Sequence[bytes]) -> bool:
        """One ``NOTIFY`` statement on the hints connection. The connection kept from an earlier hint is
        replaced when the server closed it meanwhile (a restart, an idle timeout), or when the statement
        fails on it; ``False`` when a fresh connection fails too."""
        conn = self._hints_conn
        if conn is not None and not conn.closed and _alive(conn):
            with contextlib.suppress(Exception):  # tried once more on a fresh connection
                await _call(conn, _NOTIFY, params)
                return True
        await self._drop_hints_conn()
        try:
            conn = self._hints_conn = await psycopg.AsyncConnection.connect(
                self._target.conninfo, **self._connect_kwargs()
            )
            await self._configure(conn)
            await _call(conn, _NOTIFY, params)
            return True
        except Exception:  # noqa: BLE001 - hints may be lost; the next one reconnects
            await self._drop_hints_conn()
            return False

    async def _drop_hints_conn(self) -> None:
        conn, self._hints_conn = self._hints_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def subscribe_wake_hints(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(queue)`` for every hint any process publishes on this schema's channel.

        One extra connection (outside the pool) listens while anyone is subscribed, and reconnects
        after failures; hints sent meanwhile are lost, so once it listens again every subscriber gets
        ``"*"`` (any queue) in their place. Returns an unsubscribe.
        """
        token = object()
        try:
            self._subscribers[token] = callback
            listener = self._listener
            # None yet, or one on a loop that has stopped (it never hears anything again).
            stale = listener is None or listener.done() or not listener.get_loop().is_running()
            if self._pool is not None and stale:
                self._listener = asyncio.get_running_loop().create_task(self._listen())
        except Exception:  # noqa: BLE001 - without a loop there are no hints, only polling
            pass

        def unsubscribe() -> None:
            self._subscribers.pop(token, None)
            listener = self._listener
            if not self._subscribers and listener is not None and not listener.done():
                with contextlib.suppress(Exception):  # from any thread: cancelled on its own loop
                    listener.get_loop().call_soon_threadsafe(listener.cancel)

        return unsubscribe

    def _hint_subscribers(self, hint: str) -> None:
        for callback in list(self._subscribers.values()):
            with contextlib.suppress(Exception):
                callback(hint)

    async def _listen(self) -> None:
        delay = 0.1
        listened = False  # a connection of this task listened before: hints sent since it was lost are lost
        while self._subscribers and self._pool is not None:
            try:
                conn = await psycopg.AsyncConnection.connect(self._target.conninfo, **self._connect_kwargs())
                try:
                    await conn.execute(f'LISTEN "{self._channel}"'.encode("ascii"))
                    delay = 0.1
                    if listened:
                        # Listening again: "*" (any queue, as the SQLite driver says it) stands for the hints
                        # lost meanwhile, so idle workers scan and running attempts look for cancellations.
                        self._hint_subscribers(_ANY_HINT)
                    listened = True
                    async for notice in conn.notifies():
                        self._hint_subscribers(notice.payload)
                finally:
                    with contextlib.suppress(Exception):
                        await conn.close()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reconnect below
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    # -- commits -----------------------------------------------------------------------------------

    async def _group_commit(
        self,
        state: _LoopState,
        conn: psycopg.AsyncConnection[Any],
        payload: bytes,
        locks: tuple[dict[int, bool], dict[int, bool]],
    ) -> int:
        """Commit one attempt's payload (``runlane_commit`` status: 0 committed, 1 a dependency
        changed); a failure raises its ``psycopg.Error``.

        Group commit: while one commit of this driver is in flight, attempts that reach their commit
        queue up; when it ends, the first of them commits all the queued ones on its own connection
        in one ``runlane_commit_batch`` statement: one transaction and one WAL flush, each attempt in
        a subtransaction of its own that the batch rolls back alone when the attempt fails, after
        every lock of the batch is taken in the one global order. A commit that finds none in flight
        goes out at once, alone. Batches form per event loop (``state``).
        """
        if state.committing:
            waiting = _Waiting(payload, locks, asyncio.get_running_loop().create_future())
            state.commit_queue.append(waiting)
            try:
                outcome = await waiting.future
            except BaseException:
                future = waiting.future
                if future.done() and not future.cancelled() and future.exception() is None and future.result() is _LEAD:
                    state.committing = False  # handed the lead, then cancelled: pass it on
                    _hand_off(state)
                raise
            if outcome is not _LEAD:
                return outcome
        state.committing = True
        batch: list[_Waiting] = []
        try:
            queue = state.commit_queue[: MAX_COMMIT_BATCH - 1]
            state.commit_queue = state.commit_queue[MAX_COMMIT_BATCH - 1 :]
            batch = [waiting for waiting in queue if not waiting.future.done()]  # cancelled ones commit nothing
            if not batch:
                result = await _call(conn, self._sql.commit_prepared, (payload,))
                return int(result.get_value(0, 0))
            outcomes = await self._commit_batch(conn, [(payload, locks), *((w.payload, w.locks) for w in batch)])
            for waiting, outcome in zip(batch, outcomes[1:], strict=True):
                if not waiting.future.done():
                    _settle(waiting.future, outcome)
            if isinstance(outcomes[0], BaseException):
                raise outcomes[0]
            return outcomes[0]
        except BaseException as error:
            if not isinstance(error, psycopg.Error):  # the leader was cancelled: the outcome is unknown
                error = psycopg.OperationalError(f"the commit batch was interrupted ({type(error).__name__})")
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(error)
            raise
        finally:
            state.committing = False
            _hand_off(state)

    async def _commit_batch(
        self, conn: psycopg.AsyncConnection[Any], attempts: list[tuple[bytes, tuple[dict[int, bool], dict[int, bool]]]]
    ) -> list[Any]:
        """Each attempt's status, or the ``_AttemptFailed`` it raised, from one batch statement."""
        points: dict[int, bool] = {}
        heads: dict[int, bool] = {}
        for _, (attempt_points, attempt_heads) in attempts:
            for merged, taken in ((points, attempt_points), (heads, attempt_heads)):
                for lock, shared in taken.items():
                    merged[lock] = merged.get(lock, True) and shared
        ordered = [(lock, points[lock]) for lock in sorted(points)]
        ordered += [(lock, heads[lock]) for lock in sorted(heads)]
        body = b"[" + b",".join(payload for payload, _ in attempts) + b"]"
        result = await _call(conn, self._sql.commit_batch, (orjson.dumps(ordered), body))
        if result.ntuples != len(attempts):  # pragma: no cover - one row per attempt
            raise psycopg.InterfaceError(f"a commit batch of {len(attempts)} answered {result.ntuples} rows")
        value = result.get_value
        outcomes: list[Any] = []
        for row in range(result.ntuples):
            status = int(value(row, 0))
            if status == 2:
                state = _text(value(row, 1))
                outcomes.append(_AttemptFailed(state, _text(value(row, 2)) or "", _text(value(row, 3))))
            else:
                outcomes.append(status)
        return outcomes

    # -- connections -----------------------------------------------------------------------------

    async def _acquire(self) -> psycopg.AsyncConnection[Any]:
        if self._pool is None:
            raise self._not_started()
        pool = (await self._local()).pool
        if self._unreachable:
            # The server was down at the last look: fail fast instead of waiting out pool_timeout.
            await self._reachable()
        for _ in range(self.max_size + 2):
            try:
                conn = await pool.getconn()
            except Exception as error:  # noqa: BLE001 - mapped
                raise map_postgres_error(error, f"get a connection to {self._target.display}") from error
            if _alive(conn):
                return conn
            # The server closed it while it sat in the pool (a restart, an idle timeout): drop it,
            # and fail at once when the server is down rather than waiting out pool_timeout.
            await self._return(conn, broken=True)
            await self._reachable()
        raise RunlaneError(
            ErrorCode.STORAGE_UNAVAILABLE,
            f"Could not get a live connection to {self._target.display}: every pooled one was closed by the server.",
            retryable=True,
        )

    async def _return(self, conn: psycopg.AsyncConnection[Any], *, broken: bool = False) -> None:
        if broken:
            # A connection that died may mean the server did: the next acquire checks that first.
            self._unreachable = True
        state = self._loops.get(asyncio.get_running_loop())  # the pool the connection came from
        pool = None if state is None else state.pool
        try:
            if broken or pool is None:
                await conn.close()
            if pool is not None:
                await pool.putconn(conn)
        except Exception:  # noqa: BLE001 - a connection that cannot be returned is dropped
            if not conn.closed:
                await conn.close()

    async def _recover(self) -> None:
        """After a lost connection: raise ``storage_unavailable`` at once when the server is down;
        otherwise test the pool's idle connections and replace the dead ones (a restarted server
        kills them all) so the retry gets a live one. Concurrent callers share one check."""
        await self._reachable()
        state = self._loops.get(asyncio.get_running_loop())
        if state is None:
            return
        check = state.check
        if check is None or check.done():
            check = state.check = asyncio.ensure_future(state.pool.check())
        # The check runs on: a frozen server's idle connections would hold it until their answer deadline.
        within = self.connect_timeout + self.pool_timeout
        if self.statement_timeout is not None:
            within = min(within, self.statement_timeout + _ANSWER_MARGIN_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(check), within)

    async def _reachable(self) -> None:
        """Open (and close) one fresh connection; ``storage_unavailable`` when that fails."""
        try:
            conn = await psycopg.AsyncConnection.connect(self._target.conninfo, **self._connect_kwargs())
        except Exception as error:  # noqa: BLE001 - mapped
            self._unreachable = True
            raise map_postgres_error(error, f"connect to Postgres at {self._target.display}") from error
        self._unreachable = False
        with contextlib.suppress(Exception):
            await conn.close()

    async def _run(self, doing: str, body: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        """Run a read outside transactions on a pooled connection, under its answer deadline, retrying
        once on a lost connection."""
        for attempt in range(2):
            conn = await self._acquire()
            broken = False
            try:
                return await _answered(conn, body(conn))
            except psycopg.Error as error:
                broken = _is_disconnect(error)
                if not broken or attempt > 0:
                    raise map_postgres_error(error, doing) from error
            finally:
                await self._return(conn, broken=broken)
            await self._recover()
        raise AssertionError("unreachable")  # pragma: no cover

    # -- StorageDriver ---------------------------------------------------------------------------

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        checked = check_storage_keys(keys)
        enforce_storage_limit(self.profile.limits, "max_point_reads", len(checked))
        if not checked:
            if self._pool is None:
                await self._acquire()  # the same error as any other call on a closed driver
            return []
        wanted = {key.encoded: key for key in checked}
        statement, params = self._sql.get, (_key_array(wanted),)

        async def body(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await _call(conn, statement, params)

        found = _found_records(wanted, await self._run("read records", body), self._written)
        return [found.get(key.encoded) for key in checked]

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        if not isinstance(query, StorageQuery):
            raise contract_violation("query() takes a StorageQuery.")
        enforce_storage_limit(self.profile.limits, "max_query_results", query.limit)
        shape, params = _query_params(query, exclusive=False, hold_space=self._hold_space)
        statement = _query_statement(self._sql.index_rows, shape)
        encoded = _encode_params(params)

        async def body(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await _call(conn, statement, encoded)

        return page_index_rows(query, _index_rows(await self._run("query an index", body)), look_ahead=True)

    async def with_transaction(self, callback: Callable[[StorageTransaction], Awaitable[T]]) -> T:
        reconnected = False
        for number in range(self.max_transaction_attempts):
            attempt = _PostgresAttempt(self, self._clock)
            try:
                try:
                    result = await callback(attempt)
                    committed = await attempt._commit()
                except _Replay:
                    committed = False
            finally:
                attempt.end()
                # Shielded: a second cancellation must not leak the connection or its holds.
                await asyncio.shield(attempt._release())
            if committed:
                return result
            if attempt.lost_connection is not None:
                # A pooled connection died (a restarted server): replay once on a live one.
                if reconnected:
                    raise attempt.lost_connection
                reconnected = True
                await self._recover()
            await pause_before_replay(number)
        raise create_storage_conflict_error(
            StorageConflictKind.TRANSACTION,
            f"The transaction lost validation {self.max_transaction_attempts} times; retry the operation.",
            meta={"attempts": self.max_transaction_attempts},
        )

    # -- OperatorReadDriver ----------------------------------------------------------------------

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        env = environment_key(environment)
        key, tombstone = run_key(env, run_id), run_tombstone_key(env, run_id)

        async def body(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            cursor = await conn.execute(self._sql.get_run, ([key.encoded, tombstone.encoded],))
            return await cursor.fetchall()

        rows = dict(await self._run("read a run", body))
        if tombstone.encoded in rows or key.encoded not in rows:
            return None
        run = peek_run_document(_document(key.encoded, rows[key.encoded]))
        if run is None or (environment_key(run.environment), run.id) != key.parts:
            return None
        return run.model_copy(deep=True)

    async def list_runs(self, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]:
        sql = self._sql
        query = run_list_query(
            filter, pagination, runs_table=sql.operator_runs, records_table=sql.records, placeholder="%s"
        )

        async def body(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            cursor = await conn.execute(query.text, query.params)
            return await cursor.fetchall()

        return finish_run_page(query, filter, await self._run("list runs", body))

    async def list_run_events(self, filter: RunEventFilter, pagination: PaginationParams) -> Page[RunEventRecord]:
        sql = self._sql
        query = run_event_list_query(
            filter,
            pagination,
            events_table=sql.operator_events,
            runs_table=sql.operator_runs,
            records_table=sql.records,
            placeholder="%s",
        )

        async def body(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            cursor = await conn.execute(query.text, query.params)
            return await cursor.fetchall()

        return finish_event_page(query, filter, await self._run("list run events", body))

    # -- diagnostics -----------------------------------------------------------------------------

    async def explain(
        self,
        read: StorageQuery | RunFilter | RunEventFilter,
        pagination: PaginationParams | None = None,
        *,
        analyze: bool = False,
        generic: bool = False,
        mode: StorageCandidateMode = StorageCandidateMode.ADVISORY,
    ) -> dict[str, Any]:
        """PostgreSQL's plan for the statement this driver runs for one read: the single object of
        ``EXPLAIN (FORMAT JSON)``, whose ``"Plan"`` member is the node tree.

        ``read`` is a ``StorageQuery`` (the statement of ``query()``, which core uses to find runs
        needing delivery recovery and due outbox rows; with ``mode=StorageCandidateMode.EXCLUSIVE``
        the statement of an exclusive ``query_candidates``, which workers use to claim runnable runs),
        or a ``RunFilter`` /
        ``RunEventFilter`` with ``pagination`` (the statements of ``list_runs()`` /
        ``list_run_events()``, cursor included). The statement and its parameters come from the same
        builders those methods use, so operators can check on their own data that every read is
        served by an index (``"Index Scan"`` / ``"Index Only Scan"`` nodes naming it, no ``"Seq Scan"``,
        no ``"Sort"`` above a whole table).

        ``analyze=True`` runs the statement too (``EXPLAIN ANALYZE``; it only reads) and adds actual
        row counts, timings and buffers. ``generic=True`` plans it as a prepared statement without its
        parameter values (``plan_cache_mode = force_generic_plan``): the plan PostgreSQL may switch to
        for a statement prepared on a connection and run many times.
        """
        sql = self._sql
        if isinstance(read, StorageQuery):
            enforce_storage_limit(self.profile.limits, "max_query_results", read.limit)
            shape, params = _query_params(
                read, exclusive=mode is StorageCandidateMode.EXCLUSIVE, hold_space=self._hold_space
            )
            text = _query_sql(sql.index_rows, shape)
        elif isinstance(read, RunFilter):
            listing = run_list_query(
                read,
                pagination or PaginationParams(),
                runs_table=sql.operator_runs,
                records_table=sql.records,
                placeholder="%s",
            )
            text, params = listing.text, list(listing.params)
        elif isinstance(read, RunEventFilter):
            listing = run_event_list_query(
                read,
                pagination or PaginationParams(),
                events_table=sql.operator_events,
                runs_table=sql.operator_runs,
                records_table=sql.records,
                placeholder="%s",
            )
            text, params = listing.text, list(listing.params)
        else:
            raise contract_violation("explain() takes a StorageQuery, a RunFilter or a RunEventFilter.")
        options = "FORMAT JSON, ANALYZE, BUFFERS" if analyze else "FORMAT JSON"

        async def body(conn: psycopg.AsyncConnection[Any]) -> Any:
            if not generic:
                cursor = await conn.execute(f"EXPLAIN ({options}) {text}", params)
                return (await cursor.fetchone() or (None,))[0]
            # The builders' only placeholders are %s (no literal %): number them for PREPARE.
            from psycopg import sql as pgsql

            numbers = iter(range(1, len(params) + 1))
            statement = re.sub("%s", lambda _: f"${next(numbers)}", text)
            call: pgsql.SQL | pgsql.Composed = pgsql.SQL(f"EXPLAIN ({options}) EXECUTE runlane_explain")
            if params:
                values = pgsql.SQL(", ").join(pgsql.Literal(value) for value in params)
                call = pgsql.Composed([call, pgsql.SQL("({})").format(values)])
            prepared = False
            try:
                async with conn.transaction():
                    await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                    cursor = await conn.execute("SELECT FROM pg_prepared_statements WHERE name = 'runlane_explain'")
                    if await cursor.fetchone() is not None:  # left on this connection by an interrupted call
                        await conn.execute("DEALLOCATE runlane_explain")
                    await conn.execute(f"PREPARE runlane_explain AS {statement}")
                    prepared = True
                    cursor = await conn.execute(call)
                    return (await cursor.fetchone() or (None,))[0]
            finally:
                if prepared:
                    await conn.execute("DEALLOCATE runlane_explain")

        plan = await self._run("explain a read", body)
        return orjson.loads(plan)[0] if isinstance(plan, str) else plan[0]


def postgres_storage(
    connection_string: str,
    *,
    schema: str | None = None,
    min_size: int = 1,
    max_size: int = 10,
    clock: Clock | None = None,
    limits: StorageLimits | None = None,
    max_transaction_attempts: int = 16,
    name: str = "postgres-storage",
    connect_timeout: float = 10.0,
    statement_timeout: float | None = 30.0,
    pool_timeout: float = 30.0,
) -> PostgresStorageDriver:
    """Durable Postgres storage over ``connection_string`` (``postgres://`` or ``postgresql://``).

    The schema is the explicit ``schema``, else a Prisma-style ``?schema=`` in the URL (removed before
    connecting), else ``public``; apply ``postgres_migration_sql(schema)`` (``runlane postgres migrate``)
    first: ``start()`` probes the schema and fails with ``configuration_invalid`` when it is missing.
    ``min_size`` / ``max_size`` bound the connection pool; each open transaction attempt holds one
    connection. Another event loop that uses the driver (``runlane.sync`` beside an application loop)
    gets a pool of its own, of up to ``max_size`` connections opened on demand. Every wait is bounded: ``connect_timeout`` per connection attempt, ``pool_timeout``
    for a free pooled connection, ``statement_timeout`` per statement (``None`` to leave the server's), and
    the answer to a statement 5 seconds after that, which a server that stopped answering never gives.
    """
    return PostgresStorageDriver(
        connection_string,
        schema=schema,
        min_size=min_size,
        max_size=max_size,
        clock=clock,
        limits=limits,
        max_transaction_attempts=max_transaction_attempts,
        name=name,
        connect_timeout=connect_timeout,
        statement_timeout=statement_timeout,
        pool_timeout=pool_timeout,
    )
