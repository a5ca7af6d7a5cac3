"""Create the services' PostgreSQL databases when missing; print their connection URLs for up.sh.

`python infra/services/databases.py PREFECT_DB MLFLOW_DB` reads the server from GRPOFLOW_PG_URL
(postgresql://user[:password]@host:port), creates each database it lacks, and prints one line: Prefect's URL
(asyncpg driver) and MLflow's (psycopg driver). Those carry the password and go only to up.sh's variables;
every message shows the URL masked. Exit 2 when the server cannot be reached or refuses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.redact import mask_uri, redact  # noqa: E402

CONNECT_TIMEOUT_S = 10


def main(prefect_db: str, mlflow_db: str) -> int:
    import psycopg
    from psycopg import sql

    server = os.environ.get("GRPOFLOW_PG_URL") or "postgresql://postgres@127.0.0.1:5432"
    parts = urlsplit(server)
    if parts.scheme.split("+")[0] not in ("postgresql", "postgres") or not parts.hostname:
        print(
            f"GRPOFLOW_PG_URL {mask_uri(server)}: expected postgresql://user[:password]@host:port",
            file=sys.stderr,
        )
        return 2
    admin = urlunsplit(("postgresql", parts.netloc, "/postgres", "", ""))
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            for name in (prefect_db, mlflow_db):
                if not conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone():
                    conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
                    print(f"grpoflow services: database {name} created on {mask_uri(admin)}", file=sys.stderr)
    except psycopg.Error as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"grpoflow services: PostgreSQL at {mask_uri(admin)} (GRPOFLOW_PG_URL): {redact(reason)}",
            file=sys.stderr,
        )
        return 2

    def url(driver: str, db: str) -> str:
        return urlunsplit((f"postgresql+{driver}", parts.netloc, f"/{db}", "", ""))

    print(url("asyncpg", prefect_db), url("psycopg", mlflow_db))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
