#!/usr/bin/env python3
"""A multi-replica InferFlux on loopback, for demos and end-to-end tests (issue 20, point 5).

``up`` starts, on 127.0.0.1:

* two InferFlux engines (``inferctl serve`` with the default SmolLM2, deterministic
  kernels so that either answers a greedy request alike), the "upstream fleet": one
  policy store for both (a PostgreSQL database of their own), so one API key,
  created for the gateways, works on either;
* three gateway replicas (``inferctl serve``) sharing one PostgreSQL store and one Redis
  limiter, each fronting the two engines with a model of backend ``openai``
  (``--mode upstream``; the default when that backend is installed). ``--mode local``
  makes each gateway serve the default model itself instead (three more model loads).

PostgreSQL and Redis must already be running (as on the CI machines); their databases
are created here. ``up`` prints the URLs and the gateways' admin key, then returns:
the servers keep running, each with a pid file and a log under the state directory.
``down`` stops them (SIGTERM, then SIGKILL after 30 s); ``down --purge`` also drops the
two databases, the Redis counters and the state directory. ``status`` shows what runs.

Run it with the project's interpreter (it imports the project to generate API keys):

    .venv/bin/python deploy/local/run.py up
    .venv/bin/python deploy/local/run.py status
    .venv/bin/python deploy/local/run.py down --purge
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_STATE = Path(tempfile.gettempdir()) / "inferflux-local"
MODEL = "smollm2-135m-instruct"  # the default model's id (gateway.settings.DEFAULT_MODEL_NAME)
UPSTREAM_KEY_ENV = "INFERFLUX_UPSTREAM_LOCAL_KEY"  # under upstreams.api_key_env_prefix
STOP_TIMEOUT = 30.0


class LocalError(Exception):
    """Something the operator must fix; printed without a traceback."""


# -- state ---------------------------------------------------------------------------


def load_secrets(state: Path) -> dict[str, str]:
    path = state / "secrets.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_secrets(state: Path, values: dict[str, str]) -> None:
    path = state / "secrets.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(values, handle, indent=2)


def new_key() -> str:
    from inferflux.policy.authn.apikeys import generate_key

    return generate_key().token


# -- PostgreSQL and Redis ------------------------------------------------------------


def database_url(server: str, name: str) -> str:
    return f"{server.rstrip('/')}/{name}"


def database_exists(server: str, name: str) -> bool:
    import psycopg

    with psycopg.connect(database_url(server, "postgres"), autocommit=True, connect_timeout=5) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def create_database(server: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(database_url(server, "postgres"), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(server: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(database_url(server, "postgres"), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def redis_prefix(database: str) -> str:
    """The gateways' rate-limit keys: named after their database, apart from any other deployment's."""
    return f"{database}:rl"


def clear_redis(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=prefix + ":*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def check_services(pg_server: str, redis_url: str) -> None:
    import psycopg
    import redis

    try:
        database_exists(pg_server, "postgres")
    except psycopg.Error as exc:
        raise LocalError(f"PostgreSQL at {pg_server} is not usable: {exc}") from None
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise LocalError(f"Redis at {redis_url} is not reachable: {exc}") from None
    finally:
        client.close()


# -- processes -----------------------------------------------------------------------


def inferctl() -> list[str]:
    beside = Path(sys.executable).with_name("inferctl")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "inferflux.gateway.cli"]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start(state: Path, name: str, port: int, config: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``inferctl serve`` in a session of its own (it outlives this script), with a pid file and a log."""
    config_file = state / f"{name}.yaml"
    config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
    (state / "logs").mkdir(exist_ok=True)
    (state / "pids").mkdir(exist_ok=True)
    argv = [*inferctl(), "serve", "--config", str(config_file), "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(state / "data" / name)]  # fmt: skip
    with open(state / "logs" / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
    (state / "pids" / f"{name}.pid").write_text(f"{proc.pid} {port}\n")
    return proc


def running(state: Path) -> dict[str, tuple[int, int]]:
    """name -> (pid, port) of every server whose pid file names a live ``inferctl serve`` on that port."""
    found = {}
    for pid_file in sorted((state / "pids").glob("*.pid")):
        pid, port = (int(field) for field in pid_file.read_text().split())
        if is_ours(pid, port):
            found[pid_file.stem] = (pid, port)
    return found


def is_ours(pid: int, port: int) -> bool:
    """The pid is alive and, where /proc tells, still the ``serve`` we started (a pid can be reused)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        raw = cmdline.read_bytes()
    except FileNotFoundError:  # no /proc here, or the process is gone
        return not Path("/proc/self").exists()
    # Between fork and exec a child still shows our own command line: one we just started, not a
    # stranger (a check in that instant took a starting gateway for one that had exited).
    if raw == Path("/proc/self/cmdline").read_bytes():
        return True
    argv = raw.split(b"\0")
    return b"serve" in argv and str(port).encode() in argv


def wait_ready(state: Path, procs: dict[str, tuple[subprocess.Popen[bytes], int]], timeout: float) -> None:
    """Wait until every server of ``procs`` (name -> its process and port) answers /readyz.

    Whether one has exited is asked of its process handle, not of /proc: a server this
    instant forked (or in the middle of its exec) can show another command line, or none.
    """
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for name in list(pending):
            proc, port = procs[name]
            if proc.poll() is not None:
                log = (state / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise LocalError(f"{name} exited during start-up (status {proc.returncode}); the end of its log:\n{log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    pending.remove(name)
                    print(f"  {name} ready", flush=True)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise LocalError(f"not ready after {timeout:.0f} s: {', '.join(pending)} (logs in {state / 'logs'})")
        time.sleep(0.5)


def stop_all(state: Path) -> int:
    """Stop every server of ``state``; how many were running."""
    alive = running(state)
    count = len(alive)
    for pid, _ in alive.values():
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while alive and time.monotonic() < deadline:
        alive = {name: entry for name, entry in alive.items() if is_ours(*entry)}
        time.sleep(0.2)
    for name, (pid, _) in alive.items():
        print(f"  {name} did not stop in {STOP_TIMEOUT:.0f} s: SIGKILL", flush=True)
        os.kill(pid, signal.SIGKILL)
    for pid_file in (state / "pids").glob("*.pid"):
        pid_file.unlink()
    return count


# -- the topology --------------------------------------------------------------------


def store_env(pg_server: str, database: str, passphrase: str, admin_key: str) -> dict[str, str]:
    """What puts a server on ``database``: its URL, the store's passphrase, the first admin's key."""
    return {
        "INFERFLUX_STORE_URL": database_url(pg_server, database),
        "INFERFLUX_STORE_PASSPHRASE": passphrase,
        "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key,
    }


def start_group(state: Path, ports: dict[str, int], config: dict[str, Any], env: dict[str, str],
                timeout: float) -> None:  # fmt: skip
    """Start the servers ``ports`` names, all at once, and wait until every one is ready."""
    procs = {name: (start(state, name, port, config, env), port) for name, port in ports.items()}
    wait_ready(state, procs, timeout)


def openai_backend_installed() -> bool:
    return any(ep.name == "openai" for ep in importlib.metadata.entry_points(group="inferflux.backends"))


def create_upstream_key(engine_url: str, admin_key: str) -> str:
    """A member key of a "gateways" tenant of the engines' store: what the gateways send upstream."""
    import httpx

    headers = {"authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=engine_url + "/admin/v1", headers=headers, timeout=30) as client:
        tenant = client.post("/tenants", json={"name": "gateways", "display_name": "The local gateways"})
        if tenant.status_code != 201:
            raise LocalError(f"creating the gateways' tenant on {engine_url} failed: "
                             f"{tenant.status_code} {tenant.text}")  # fmt: skip
        key = client.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "local gateways", "role": "member"})
        if key.status_code != 201:
            raise LocalError(f"creating the gateways' key on {engine_url} failed: {key.status_code} {key.text}")
        return str(key.json()["key"])


def up(args: argparse.Namespace) -> None:
    state: Path = args.state_dir
    if args.fresh:
        down(argparse.Namespace(state_dir=state, purge=True, pg_server=args.pg_server, redis_url=args.redis_url,
                                database=args.database))  # fmt: skip
    if state.exists() and running(state):
        raise LocalError(f"already running (state in {state}); `down` first")
    mode = args.mode if args.mode != "auto" else ("upstream" if openai_backend_installed() else "local")
    if mode == "upstream" and not openai_backend_installed():
        raise LocalError("--mode upstream needs the openai backend (entry point 'openai' in inferflux.backends)")
    ports = [args.engine_port + i for i in range(args.engines)] + [args.gateway_port + i for i in range(args.gateways)]
    busy = [port for port in ports if not port_free(port)]
    if busy:
        raise LocalError(f"ports in use on 127.0.0.1: {busy} (choose others with --engine-port / --gateway-port)")
    check_services(args.pg_server, args.redis_url)

    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        start_servers(args, state, mode)
    except BaseException:  # a failed or interrupted start leaves nothing running
        stop_all(state)
        raise


def start_servers(args: argparse.Namespace, state: Path, mode: str) -> None:
    values = load_secrets(state)
    engine_ports = [args.engine_port + i for i in range(args.engines)]
    gateway_ports = [args.gateway_port + i for i in range(args.gateways)]
    fleet_db, gateway_db = args.database + "_fleet", args.database
    for name in (fleet_db, gateway_db):
        if database_exists(args.pg_server, name):
            if "passphrase" not in values:
                raise LocalError(f"database {name} exists but {state} holds no passphrase for it: "
                                 "start with --fresh (drops it) or pick --database")  # fmt: skip
        else:
            create_database(args.pg_server, name)
            print(f"created database {name}")
            if name == fleet_db:
                values.pop("upstream_key", None)  # a key of a store that is gone
    for name in ("passphrase", "admin_key", "fleet_passphrase", "fleet_admin_key"):
        values.setdefault(name, new_key() if name.endswith("admin_key") else secrets.token_urlsafe(24))
    save_secrets(state, values)

    engines = [f"engine-{i + 1}" for i in range(args.engines)]
    fleet_env = store_env(args.pg_server, fleet_db, values["fleet_passphrase"], values["fleet_admin_key"])
    # Deterministic (batch-invariant) kernels: a fleet's replicas must answer a greedy request
    # alike whichever engine serves it, whatever shares its steps or sits in its prefix cache. In
    # bfloat16 without them, three gateways over two engines answered one prompt two ways on a
    # 2-core Intel Xeon (a clean-clone CI run of 2026-11-26); docs/backends.md, deterministic mode.
    engine_config = {"engine": {"kv_cache_bytes": args.kv_cache_bytes, "deterministic": True}}
    print(f"starting {len(engines)} engines (the default model; the first start builds the CPU kernels)...")
    start_group(state, dict(zip(engines, engine_ports, strict=True)), engine_config, fleet_env, args.timeout)
    if engines and "upstream_key" not in values:
        values["upstream_key"] = create_upstream_key(f"http://127.0.0.1:{engine_ports[0]}", values["fleet_admin_key"])
        save_secrets(state, values)

    gateways = [f"gateway-{i + 1}" for i in range(args.gateways)]
    gateway_env = {
        **store_env(args.pg_server, gateway_db, values["passphrase"], values["admin_key"]),
        "INFERFLUX_REDIS_URL": args.redis_url,
        UPSTREAM_KEY_ENV: values.get("upstream_key", ""),
    }
    gateway_config: dict[str, Any] = {
        "ratelimit": {"backend": "redis", "redis_prefix": redis_prefix(gateway_db)},
        "model_registry": {"poll_seconds": 1},
    }
    if mode == "upstream":
        if not engines:
            raise LocalError("--mode upstream needs at least one engine")
        gateway_config["models"] = [{
            "name": MODEL,
            "backend": "openai",
            "upstream": {
                "endpoints": [f"http://127.0.0.1:{port}/v1" for port in engine_ports],
                "model": MODEL,
                "api_key_env": UPSTREAM_KEY_ENV,
                "timeout_seconds": 600,
                "max_inflight_per_endpoint": 64,
            },
        }]  # fmt: skip
        gateway_config["upstreams"] = {"allowed_hosts": ["127.0.0.1"]}
    else:
        gateway_config["engine"] = {"kv_cache_bytes": args.kv_cache_bytes, "deterministic": True}
    print(f"starting {len(gateways)} gateways ({mode} mode: "
          f"{'fronting the engines' if mode == 'upstream' else 'each serving the model itself'})...")  # fmt: skip
    start_group(state, dict(zip(gateways, gateway_ports, strict=True)), gateway_config, gateway_env, args.timeout)

    print()
    for name, port in zip(gateways, gateway_ports, strict=True):
        print(f"{name}:  http://127.0.0.1:{port}/v1")
    for name, port in zip(engines, engine_ports, strict=True):
        role = "upstream" if mode == "upstream" else "not fronted: --mode local"
        print(f"{name}:   http://127.0.0.1:{port}/v1  ({role})")
    print(f"\ngateways' platform-admin key: {values['admin_key']}")
    print(f"engines' platform-admin key:  {values['fleet_admin_key']}")
    print(f"store: {database_url(args.pg_server, gateway_db)}; limits: {args.redis_url} ({redis_prefix(gateway_db)}:*)")
    again = f"{sys.argv[0]}" + ("" if state == DEFAULT_STATE else f" --state-dir {state}")
    print(f"logs and pid files: {state}; stop with: {again} down [--purge]")


def down(args: argparse.Namespace) -> None:
    state: Path = args.state_dir
    if (state / "pids").exists():
        print(f"stopped {stop_all(state)} servers")
    if args.purge:
        for name in (args.database, args.database + "_fleet"):
            drop_database(args.pg_server, name)
        removed = clear_redis(args.redis_url, redis_prefix(args.database))
        shutil.rmtree(state, ignore_errors=True)
        print(f"dropped {args.database} and {args.database}_fleet, {removed} Redis keys, {state}")


def status(args: argparse.Namespace) -> None:
    import httpx

    alive = running(args.state_dir) if (args.state_dir / "pids").exists() else {}
    if not alive:
        print("nothing running")
    for name, (pid, port) in alive.items():
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json().get("status", "?")
        except (httpx.HTTPError, ValueError):
            ready = "not answering"
        print(f"{name:10} pid {pid:<8} http://127.0.0.1:{port}  {ready}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'run.py COMMAND --help' for a command's options; docs/deployment.md has the whole picture.",
    )  # fmt: skip
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE,
                        help=f"pid files, logs, data directories and the generated secrets (default: {DEFAULT_STATE})")
    parser.add_argument("--pg-server", default="postgresql://postgres@127.0.0.1:5432",
                        help="PostgreSQL server URL, without a database (default: %(default)s)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis URL (default: %(default)s)")
    parser.add_argument("--database", default="inferflux_local",
                        help="the gateways' database; the engines' is its name + _fleet (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    start_parser = sub.add_parser("up", help="create the databases and start the engines and the gateways")
    start_parser.add_argument("--mode", choices=["auto", "upstream", "local"], default="auto",
                              help="upstream: the gateways front the engines (backend openai); local: each gateway "
                              "serves the model itself; auto: upstream when the openai backend is installed")
    start_parser.add_argument("--engines", type=int, default=2, help="upstream engines (default: %(default)s)")
    start_parser.add_argument("--gateways", type=int, default=3, help="gateway replicas (default: %(default)s)")
    start_parser.add_argument("--engine-port", type=int, default=8190,
                              help="the first engine's port; the others follow (default: %(default)s)")
    start_parser.add_argument("--gateway-port", type=int, default=8090,
                              help="the first gateway's port; the others follow (default: %(default)s)")
    start_parser.add_argument("--kv-cache-bytes", default="128MiB",
                              help="each engine's KV cache (default: %(default)s)")
    start_parser.add_argument("--timeout", type=float, default=300.0,
                              help="seconds each group of servers gets to become ready (default: %(default)s)")
    start_parser.add_argument("--fresh", action="store_true",
                              help="first do `down --purge`: new databases, counters and secrets")
    start_parser.set_defaults(handler=up)

    stop_parser = sub.add_parser("down", help="stop everything `up` started")
    stop_parser.add_argument("--purge", action="store_true",
                             help="also drop both databases, the Redis counters and the state directory")
    stop_parser.set_defaults(handler=down)

    sub.add_parser("status", help="list the running servers and their readiness").set_defaults(handler=status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except LocalError as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
