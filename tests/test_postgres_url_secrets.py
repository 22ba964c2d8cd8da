"""Secret-bearing Postgres URL parameters (``sslpassword``, ...) never reach a message: Runlane names the
malformed parameter instead of quoting libpq's parse error, and masks every query value of a URL it shows.
No database is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import cli
from postgres_support import assert_refused_without_quoting
from psycopg.conninfo import conninfo_to_dict
from runlane_postgres import resolve_postgres_connection


@pytest.mark.parametrize(
    "url, secrets, says",
    [
        (
            "postgresql://app@db.internal/app?sslmode=verify-full&sslpassword=KeyPass%_secret",
            ["KeyPass", "_secret"],
            "sslpassword parameter has a '%' that does not start a percent-encoded byte",
        ),
        ("postgresql://app@db/app?sslpassword=KeyPa%00ss", ["KeyPa", "00ss"], "sslpassword parameter encodes a zero"),
        ("postgresql://app@db/app?sslpassword=Key Pass", ["Key Pass", "Pass"], "sslpassword parameter has a space"),
        ("postgresql://app@db/app?sslpassword=S3cr=et", ["S3cr", "=et"], "sslpassword parameter has a second '='"),
        # An '&' in the passphrase that is not percent-encoded: libpq would quote what follows it.
        ("postgresql://app@db/app?sslpassword=Key&Pass9", ["Key", "Pass9"], "without '=' after its sslpassword"),
        ("postgresql://app@db/app?sslpassword=Key&Pa=ss9", ["Key", "Pa", "ss9"], "libpq does not know after its"),
        # libpq quotes the whole URL: every query value is masked, the names are kept.
        (
            "postgresql://app:dbpass@[::1/app?sslpassword=KeyPassSecret",
            ["dbpass", "KeyPassSecret"],
            '"postgresql://***@[::1/app?sslpassword=***"',
        ),
        (
            "postgresql://app@[::1]x/app?sslmode=require&sslpassword=KeyPassSecret",
            ["KeyPassSecret"],
            '"postgresql://***@[::1]x/app?sslmode=***&sslpassword=***"',
        ),
        # A password with a '/' or '?' not percent-encoded: libpq would end the user name at the '/' and take
        # the rest for the host, database or query, and quote a piece of the password when refusing it.
        ("postgresql://app:Kx9/tR?w8Zq@127.0.0.1:5432/db", ["Kx9", "tR", "w8Zq"], "has an '@' after its user name"),
        ("postgresql://app:Kx9/tR?sslmode=w8Zq@127.0.0.1/db", ["Kx9", "tR", "w8Zq"], "has an '@' after its user"),
        ("postgresql://app:Kx9/tR?Long=zP=4@127.0.0.1/db", ["Kx9", "tR", "zP=4"], "has an '@' after its user"),
        ("postgresql://app:ab@Secret9?tail7@127.0.0.1/db", ["Secret9", "tail7"], "has an '@' after its user"),
        # A malformed value of a parameter that is no secret is named, not quoted, too.
        ("postgresql://app@db/app?options=-c%20x%3D%zzTok", ["zzTok"], "options parameter has a '%'"),
    ],
)
def test_a_secret_parameter_is_never_quoted_when_the_url_is_refused(url: str, secrets: list[str], says: str) -> None:
    assert_refused_without_quoting(url, secrets, says)


@pytest.mark.parametrize(
    "url, passphrase",
    [
        ("postgresql://app@db/app?sslmode=verify-full&sslpassword=Key%26Pa%3Dss%25", "Key&Pa=ss%"),
        ("postgresql://app@db/app?sslpassword=KeyPass&sslmode=require&", "KeyPass"),  # a trailing "&" libpq ignores
        ("postgresql://app@db/app?sslpassword=KeyPass&ssl=true&schema=s1", "KeyPass"),  # libpq's JDBC-style alias
    ],
)
def test_a_percent_encoded_passphrase_is_accepted(url: str, passphrase: str) -> None:
    target = resolve_postgres_connection(url)
    assert conninfo_to_dict(target.conninfo)["sslpassword"] == passphrase
    assert "KeyPass" not in repr(target) and target.display == "db/app"


def test_cli_migrate_never_prints_a_passphrase(tmp_path: Path) -> None:
    for url in (
        "postgresql://app@db.internal/app?sslmode=verify-full&sslpassword=KeyPass%_secret",
        "postgresql://app:dbpass@[::1/app?sslpassword=KeyPassSecret",
    ):
        result = cli(tmp_path, "postgres", "migrate", "--url", url)
        assert result.returncode == 1 and "error[configuration_invalid]" in result.stderr, result.stderr
        assert "KeyPass" not in result.stdout + result.stderr and "dbpass" not in result.stderr, result.stderr
        as_json = cli(tmp_path, "--json", "postgres", "migrate", "--url", url)
        assert json.loads(as_json.stderr)["error"]["code"] == "configuration_invalid"
        assert "KeyPass" not in as_json.stdout + as_json.stderr
