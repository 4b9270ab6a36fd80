"""``inferctl``: run the server, and small clients for a running one."""

from __future__ import annotations

import argparse
import functools
import getpass
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx

from gateway.settings import ConfigError, Settings, ensure_data_dir, load_settings
from policy.errors import PolicyError, StoreConfigError

if TYPE_CHECKING:  # SQLAlchemy is imported by the store commands only
    from sqlalchemy import Engine

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's own code for bad usage; bad configuration is the same kind of mistake

DEFAULT_URL = "http://127.0.0.1:8080"


class ClientError(Exception):
    """A client command failed in a way worth one line, not a traceback."""


def _error(message: str) -> None:
    print(f"inferctl: error: {message}", file=sys.stderr)


# -- serve --------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(
            args.config,
            overrides={
                "host": args.host,
                "port": args.port,
                "data_dir": args.data_dir,
                "log_level": args.log_level,
                "backend": args.backend,
                "dtype": args.dtype,
                "model": args.model,
                "model_name": args.model_name,
                "engine.kv_cache_bytes": args.kv_cache_bytes,
                "max_body_bytes": args.max_body_bytes,
            },
        )
        ensure_data_dir(settings.data_dir)
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _error(f"cannot create the data directory: {exc}")
        return EXIT_FAILURE

    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from gateway import log_redaction

    log_redaction.install()  # no credential reaches a log line (the access log prints query strings)

    # Imported here: loading pulls in the engine and backends, which --help and
    # the client commands do not need.
    from backends.base import BackendError
    from gateway import drain
    from gateway.app import create_app
    from gateway.slowclients import server_options
    from gateway.models import ModelManager, engine_config_from, load_served_model

    from gateway.model_admin import ModelAdmin
    from policy.store import PolicyStore

    # The store first: a wrong key or an unreachable database should fail in
    # a second, not after the models have loaded.
    try:
        store = PolicyStore.open(settings.store, settings.data_dir)
        admin_key = store.ensure_bootstrap_admin(os.environ.get("INFERFLUX_BOOTSTRAP_ADMIN_KEY"))
    except StoreConfigError as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except Exception as exc:  # the driver's: connection refused, authentication failed, ...
        _error(f"cannot open the policy store: {getattr(exc, 'orig', None) or exc}")
        return EXIT_FAILURE
    if admin_key is not None:
        _announce_admin_key(admin_key)

    specs = settings.model_specs()
    manager = ModelManager(expected=[spec.name for spec, _ in specs])
    for spec, backend in specs:
        try:
            config = engine_config_from(settings.engine, settings.model_speculative(spec.name))
            manager.add(load_served_model(spec, backend, config, priority=settings.runtime.backend_priority))
        except (BackendError, OSError, ValueError) as exc:
            _error(f"cannot load model {spec.name!r} ({spec.path}) on backend {backend!r}: {exc}")
            manager.shutdown()
            store.close()
            return EXIT_FAILURE
    configured = {spec.name for spec, _ in specs}
    # Models loaded over the admin API before the restart; one that fails to load is logged and skipped.
    ModelAdmin(manager, store, settings, configured).restore()

    # The app closes the store at shutdown: uvicorn re-raises the signal that
    # stopped it, so nothing after uvicorn.run() is sure to run.
    app = create_app(settings, manager, store=store, owns_store=True, configured_models=configured)
    drain.serve(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=log_redaction.log_config(),
        # SIGTERM: readiness fails, new requests get 503, requests in flight get this long.
        grace=settings.server.shutdown_grace_seconds,
        # Slow clients: header and keep-alive deadlines (the body's is a middleware of the app).
        **server_options(settings.input_limits),
    )
    return EXIT_OK


def _backends(args: argparse.Namespace) -> int:
    from backends import registry
    from backends.base import BackendError

    priority = load_settings(args.config).runtime.backend_priority
    try:
        chain = registry.configured_priority(priority)
        statuses = registry.statuses(priority=chain)
    except BackendError as exc:  # a malformed INFERFLUX_BACKEND_PRIORITY
        raise ConfigError(str(exc)) from None
    # The chain's first available backend: the one 'serve' takes for "auto".
    chosen = next((s.name for s in statuses if s.name in chain and s.available), None)
    if args.json:
        print(json.dumps({
            "backends": [{**vars(s), "priority": chain.index(s.name) + 1 if s.name in chain else None}
                         for s in statuses],
            "priority": list(chain),
            "auto": chosen,
        }, indent=2))
        return EXIT_OK
    rows = [("BACKEND", "PRIORITY", "AVAILABLE", "PROVIDED BY", "REASON")]
    for s in statuses:
        available = "yes" if s.available else ("blocked" if not s.allowed else "no")
        rank = str(chain.index(s.name) + 1) if s.name in chain else "-"
        rows.append((s.name, rank, available, s.provider or "-", s.reason or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])
    print(f"\nauto: {chosen or 'nothing in the priority chain can run here'} (priority: {', '.join(chain)})")
    return EXIT_OK


def _announce_admin_key(key: str) -> None:
    """The generated platform-admin key, on stderr, once: it is stored only as a hash."""
    bar = "=" * 72
    print(
        f"{bar}\n"
        "A platform-admin API key was created for this new policy store. It is shown\n"
        "only now; keep it somewhere safe (set INFERFLUX_BOOTSTRAP_ADMIN_KEY before the\n"
        "first start to choose it yourself):\n\n"
        f"    {key}\n\n"
        "Use it as 'Authorization: Bearer <key>' (or INFERFLUX_API_KEY for inferctl).\n"
        f"{bar}",
        file=sys.stderr,
        flush=True,
    )


# -- the policy store -----------------------------------------------------------


def _audit_checkpoint(args: argparse.Namespace, chain_id: str) -> tuple[Any, Any]:
    """``audit verify --checkpoints``: the latest signed checkpoint of ``chain_id`` in the configured store,
    and the signer (its key derived from the store's secret) that checks it. OSError if the store cannot be read."""
    from sqlalchemy.exc import SQLAlchemyError

    from policy.audit.checkpoint import CHECKPOINT_PURPOSE, CheckpointSigner
    from policy.audit.store import AuditStore
    from policy.store import PolicyStore

    try:
        settings = _store_settings(args)
        store = PolicyStore.open(settings.store, settings.data_dir)
        try:
            signer = CheckpointSigner(store.derive_secret(CHECKPOINT_PURPOSE))
            return AuditStore(store.engine).latest_checkpoint(chain_id), signer
        finally:
            store.close()
    except (ConfigError, StoreConfigError, SQLAlchemyError, PolicyError) as exc:
        raise OSError(f"the policy store: {getattr(exc, 'orig', None) or exc}") from None



def _store_command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report the store's failures in one line: a wrong key, an unreachable database, a bad path."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            return handler(args)
        except (StoreConfigError, OSError) as exc:
            raise ClientError(str(exc)) from None
        except SQLAlchemyError as exc:
            raise ClientError(f"the policy store failed: {getattr(exc, 'orig', None) or exc}") from None

    return run


def _store_settings(args: argparse.Namespace) -> Settings:
    """The same settings ``serve`` reads (file, environment, --data-dir); ConfigError if invalid."""
    settings = load_settings(args.config, overrides={"data_dir": args.data_dir})
    ensure_data_dir(settings.data_dir)
    # Warnings only: a generated key file must be reported, Alembic's progress need not be.
    logging.basicConfig(level=logging.WARNING, format="inferctl: %(levelname)s: %(message)s")
    return settings


@contextmanager
def _store_engine(args: argparse.Namespace) -> Iterator[tuple[Engine, str]]:
    """An engine on the configured store, and how to name it (without a password)."""
    # Imported here, like the server: SQLAlchemy and Alembic are not needed for --help.
    from policy.store.db import create_store_engine, describe_url

    settings = _store_settings(args)
    url = settings.store.database_url(settings.data_dir)
    engine = create_store_engine(url, settings.store)
    try:
        yield engine, describe_url(url)
    finally:
        engine.dispose()


def _print_revision(engine: Engine, where: str) -> None:
    from policy.store import migrate

    revision, head = migrate.current(engine), migrate.head()
    state = "head" if revision == head else f"head is {head}"
    print(f"{where}: revision {revision or 'none (empty)'} ({state})")


@_store_command
def _db_upgrade(args: argparse.Namespace) -> int:
    from policy.store import migrate

    with _store_engine(args) as (engine, where):
        migrate.upgrade(engine, args.revision)
        _print_revision(engine, where)
    return EXIT_OK


@_store_command
def _db_downgrade(args: argparse.Namespace) -> int:
    from policy.store import migrate

    with _store_engine(args) as (engine, where):
        migrate.downgrade(engine, args.revision)
        _print_revision(engine, where)
    return EXIT_OK


@_store_command
def _db_current(args: argparse.Namespace) -> int:
    with _store_engine(args) as (engine, where):
        _print_revision(engine, where)
    return EXIT_OK


def _new_passphrase() -> str:
    passphrase = os.environ.get("INFERFLUX_STORE_NEW_PASSPHRASE")
    if passphrase:
        return passphrase
    if not sys.stdin.isatty():
        raise ClientError("--new-passphrase: set INFERFLUX_STORE_NEW_PASSPHRASE, or run on a terminal to be asked")
    passphrase = getpass.getpass("New store passphrase: ")
    if not passphrase:
        raise ClientError("the new passphrase is empty")
    if getpass.getpass("Repeat it: ") != passphrase:
        raise ClientError("the passphrases differ")
    return passphrase


@_store_command
def _rotate_key(args: argparse.Namespace) -> int:
    from policy.store import PolicyStore

    settings = _store_settings(args)
    new_passphrase = _new_passphrase() if args.new_passphrase else None

    def progress(table: str, rows: int) -> None:
        if rows and args.verbose:
            print(f"  {table}: {rows} rows re-encrypted", file=sys.stderr)

    with PolicyStore.open(settings.store, settings.data_dir) as store:
        report = store.rotate_key(
            new_passphrase=new_passphrase, prune=args.prune, batch_size=args.batch_size, on_progress=progress
        )
    print(
        f"key version {report.active_version} is active; "
        f"re-encrypted {report.values} secret(s) in {report.rows} row(s)"
    )
    if report.pruned_versions:
        print(f"removed key versions {', '.join(map(str, report.pruned_versions))}")
    elif report.previous_versions:
        print(
            f"key versions {', '.join(map(str, report.previous_versions))} are kept to read backups made "
            "before this rotation; remove them with --prune"
        )
    if new_passphrase is not None:
        print("restart every server with the new passphrase (INFERFLUX_STORE_PASSPHRASE)")
    return EXIT_OK


# -- clients ------------------------------------------------------------------


def _client(args: argparse.Namespace) -> httpx.Client:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(10.0, read=None))


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        response.read()
        message = response.json()["error"]["message"]
    except Exception:  # not an OpenAI-shaped error: show what came back
        message = response.text[:500]
    raise ClientError(f"HTTP {response.status_code}: {message}")


def _models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.get("/v1/models")
        _raise_for_error(response)
        data = response.json()["data"]
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for model in data:
        aliases = ", ".join(model.get("aliases") or [])
        print(f"{model['id']}" + (f"  (aliases: {aliases})" if aliases else ""))
    return EXIT_OK


# -- admin API clients ---------------------------------------------------------------


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    with _client(args) as client:
        response = client.request(method, "/admin/v1" + path, json=body)
        _raise_for_error(response)
        return response.json() if response.content else None


def _print_rows(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    """A plain table: easy to read, easy to cut/awk."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(none)"
    return str(value)


def _list_all(args: argparse.Namespace, path: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = _admin_call(args, "GET", f"{path}?limit=200" + (f"&after={after}" if after else ""))
        rows += page["data"]
        after = page.get("next_cursor")
        if not after:
            return rows


def _show(args: argparse.Namespace, value: Any, columns: Sequence[str]) -> int:
    if args.json:
        print(json.dumps(value, indent=2))
    else:
        _print_rows(value if isinstance(value, list) else [value], columns)
    return EXIT_OK


def _models_list(value: str | None) -> list[str] | None:
    return None if value is None else [m.strip() for m in value.split(",") if m.strip()]


_TENANT_COLUMNS = ("id", "name", "display_name", "disabled", "allowed_models")
_KEY_COLUMNS = ("id", "prefix", "name", "role", "expires_at", "revoked_at", "last_used_at")


def _whoami(args: argparse.Namespace) -> int:
    return _show(args, _admin_call(args, "GET", "/whoami"), ("tenant", "subject", "roles", "scopes"))


def _tenants(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _show(args, _list_all(args, "/tenants"), _TENANT_COLUMNS)
    if args.action == "create":
        body = {"name": args.name, "display_name": args.display_name, "allowed_models": _models_list(args.models)}
        return _show(args, _admin_call(args, "POST", "/tenants", body), _TENANT_COLUMNS)
    if args.action == "disable":
        return _show(args, _admin_call(args, "PATCH", f"/tenants/{args.tenant}", {"disabled": True}), _TENANT_COLUMNS)
    if args.action == "enable":
        return _show(args, _admin_call(args, "PATCH", f"/tenants/{args.tenant}", {"disabled": False}), _TENANT_COLUMNS)
    _admin_call(args, "DELETE", f"/tenants/{args.tenant}")
    print(f"deleted tenant {args.tenant}")
    return EXIT_OK


def _print_new_key(args: argparse.Namespace, record: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(record, indent=2))
        return EXIT_OK
    # The key alone on stdout, so it can be captured; what it is, on stderr.
    print(f"{record['role']} key {record['id']} (prefix {record['prefix']}); shown only now:", file=sys.stderr)
    print(record["key"])
    return EXIT_OK


def _keys(args: argparse.Namespace) -> int:
    base = f"/tenants/{args.tenant}/keys"
    if args.action == "list":
        return _show(args, _list_all(args, base), _KEY_COLUMNS)
    if args.action == "create":
        body = {
            "name": args.name,
            "role": args.role,
            "allowed_models": _models_list(args.models),
            "expires_in_seconds": args.expires_in,
        }
        return _print_new_key(args, _admin_call(args, "POST", base, body))
    if args.action == "rotate":
        return _print_new_key(
            args, _admin_call(args, "POST", f"{base}/{args.key_id}/rotate", {"grace_seconds": args.grace})
        )
    return _show(args, _admin_call(args, "POST", f"{base}/{args.key_id}/revoke"), _KEY_COLUMNS)


def _sse_payloads(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise ClientError(payload["error"].get("message", "error in stream"))
        yield payload


def _generate(args: argparse.Namespace, path: str, body: dict[str, Any], text_of: Any) -> int:
    model = args.model
    with _client(args) as client:
        if model is None:
            response = client.get("/v1/models")
            _raise_for_error(response)
            models = response.json()["data"]
            if not models:
                raise ClientError("the server serves no model")
            model = models[0]["id"]
        body = {**body, "model": model, "max_tokens": args.max_tokens, "stream": not args.no_stream}
        if args.temperature is not None:
            body["temperature"] = args.temperature
        if args.no_stream:
            response = client.post(path, json=body)
            _raise_for_error(response)
            print(text_of(response.json()["choices"][0], full=True))
            return EXIT_OK
        with client.stream("POST", path, json=body) as response:
            _raise_for_error(response)
            for payload in _sse_payloads(response):
                for choice in payload.get("choices", []):
                    print(text_of(choice, full=False), end="", flush=True)
        print()
    return EXIT_OK


def _complete(args: argparse.Namespace) -> int:
    def text_of(choice: dict[str, Any], full: bool) -> str:
        return str(choice.get("text") or "")

    return _generate(args, "/v1/completions", {"prompt": args.prompt}, text_of)


def _chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})

    def text_of(choice: dict[str, Any], full: bool) -> str:
        part = choice.get("message" if full else "delta") or {}
        return str(part.get("content") or "")

    return _generate(args, "/v1/chat/completions", {"messages": messages}, text_of)


# -- argument parsing ---------------------------------------------------------


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("INFERFLUX_URL", DEFAULT_URL),
        help="base URL of the server (default: $INFERFLUX_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("INFERFLUX_API_KEY"),
        help="sent as a bearer token (default: $INFERFLUX_API_KEY)",
    )


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {value!r}")
    return number


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML settings file, as for serve (env: INFERFLUX_CONFIG)")
    parser.add_argument(
        "--data-dir", metavar="DIR", help="state directory, as for serve (env: INFERFLUX_DATA_DIR)"
    )


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model id (default: the first model the server lists)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0 for greedy (default: the server's)")
    parser.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferctl",
        description="InferFlux: an OpenAI-compatible LLM inference gateway.",
        epilog="Run 'inferctl COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve",
        help="load the models and serve the OpenAI-compatible API",
        description=(
            "Load the configured models and serve the OpenAI-compatible API. Settings come from "
            "the flags, then INFERFLUX_* environment variables, then the YAML config file, then "
            "defaults. Without a model, the bundled SmolLM2-135M-Instruct is served as "
            "'smollm2-135m-instruct'."
        ),
    )
    serve.add_argument("--config", metavar="FILE", help="YAML settings file (env: INFERFLUX_CONFIG)")
    serve.add_argument(
        "--model",
        metavar="PATH",
        help="serve this one model, a GGUF file or a safetensors directory, instead of the "
        "configured list (env: INFERFLUX_MODEL)",
    )
    serve.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model id clients send for --model (default: derived from the file name; "
        "env: INFERFLUX_MODEL_NAME)",
    )
    serve.add_argument(
        "--backend",
        metavar="NAME",
        help="backend for models that do not name one: auto, or a name 'inferctl backends' lists "
        "(default: auto, the first available of runtime.backend_priority / INFERFLUX_BACKEND_PRIORITY, "
        "by default cuda, metal, cpu, mlx; env: INFERFLUX_BACKEND)",
    )
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="weight and activation dtype for models that do not name one (default: auto; env: INFERFLUX_DTYPE)",
    )
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1; env: INFERFLUX_HOST)")
    serve.add_argument("--port", type=int, help="port to listen on (default: 8080; env: INFERFLUX_PORT)")
    serve.add_argument(
        "--data-dir",
        metavar="DIR",
        help="state directory, created mode 0700 (default: $XDG_DATA_HOME/inferflux or "
        "~/.local/share/inferflux; env: INFERFLUX_DATA_DIR)",
    )
    serve.add_argument(
        "--kv-cache-bytes",
        metavar="SIZE",
        help="memory for each model's KV cache, e.g. 512MiB (default: the engine's; env: INFERFLUX_KV_CACHE_BYTES)",
    )
    serve.add_argument(
        "--max-body-bytes",
        metavar="SIZE",
        help="largest accepted request body, e.g. 4MiB (default: 4MiB; env: INFERFLUX_MAX_BODY_BYTES)",
    )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log verbosity (default: info; env: INFERFLUX_LOG_LEVEL)",
    )
    serve.set_defaults(handler=_serve)

    backends = sub.add_parser(
        "backends",
        help="list the installed backends, whether each can run here and why not",
        description=(
            "List every backend registered under the 'inferflux.backends' entry point group (and every "
            "name in the priority chain), whether it is allowed (INFERFLUX_BACKENDS_ALLOWED) and available "
            "here, and the reason when it is not; then which backend 'auto' picks. Needs no server."
        ),
    )
    backends.add_argument("--config", metavar="FILE", help="YAML settings file, for runtime.backend_priority "
                          "(env: INFERFLUX_CONFIG)")
    backends.add_argument("--json", action="store_true", help="print the statuses as JSON")
    backends.set_defaults(handler=_backends)

    models = sub.add_parser("models", help="list the models a running server serves")
    _add_client_options(models)
    models.add_argument("--json", action="store_true", help="print the raw model objects")
    models.set_defaults(handler=_models)

    whoami = sub.add_parser("whoami", help="show who the API key belongs to and what it may do")
    _add_client_options(whoami)
    whoami.add_argument("--json", action="store_true", help="print the raw response")
    whoami.set_defaults(handler=_whoami)

    tenants = sub.add_parser("tenants", help="manage tenants on a running server (platform admin)")
    tenants_sub = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    tenants_sub.add_parser("list", help="list every tenant")
    create_tenant = tenants_sub.add_parser("create", help="create a tenant")
    create_tenant.add_argument("name", help="lower-case slug: a-z, 0-9, '-'")
    create_tenant.add_argument("--display-name")
    create_tenant.add_argument("--models", help="comma-separated model allow-list (default: every model)")
    for action, text in (("disable", "stop every key and token of a tenant"), ("enable", "undo disable"),
                         ("delete", "delete a tenant with its keys and bindings")):
        tenants_sub.add_parser(action, help=text).add_argument("tenant", help="tenant id")
    for action_parser in tenants_sub.choices.values():
        _add_client_options(action_parser)
        action_parser.add_argument("--json", action="store_true", help="print the raw response")
    tenants.set_defaults(handler=_tenants)

    keys = sub.add_parser("keys", help="manage a tenant's API keys on a running server")
    keys_sub = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    keys_sub.add_parser("list", help="list a tenant's keys (prefixes only)").add_argument("tenant", help="tenant id")
    create_key = keys_sub.add_parser("create", help="create a key; it is printed on stdout, once")
    create_key.add_argument("tenant", help="tenant id")
    create_key.add_argument("--name", required=True, help="what the key is for")
    create_key.add_argument("--role", required=True, choices=["platform-admin", "tenant-admin", "member", "viewer"])
    create_key.add_argument("--models", help="comma-separated: narrows the tenant's model allow-list")
    create_key.add_argument("--expires-in", type=_positive_int, metavar="SECONDS", help="lifetime (default: none)")
    rotate_key = keys_sub.add_parser("rotate", help="replace a key; the old one works for --grace seconds more")
    rotate_key.add_argument("tenant", help="tenant id")
    rotate_key.add_argument("key_id", help="key id (key_...)")
    rotate_key.add_argument("--grace", type=int, default=3600, help="seconds (default: %(default)s)")
    revoke_key = keys_sub.add_parser("revoke", help="revoke a key now (every replica within seconds)")
    revoke_key.add_argument("tenant", help="tenant id")
    revoke_key.add_argument("key_id", help="key id (key_...)")
    for action_parser in keys_sub.choices.values():
        _add_client_options(action_parser)
        action_parser.add_argument("--json", action="store_true", help="print the raw response")
    keys.set_defaults(handler=_keys)

    from gateway.cli_idps import add_idps_parser  # it uses this module's client helpers

    add_idps_parser(sub)

    complete = sub.add_parser("complete", help="complete a prompt on a running server")
    complete.add_argument("prompt", help="the text to continue")
    _add_client_options(complete)
    _add_generation_options(complete)
    complete.set_defaults(handler=_complete)

    chat = sub.add_parser("chat", help="send one chat message to a running server")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", help="a system prompt")
    _add_client_options(chat)
    _add_generation_options(chat)
    chat.set_defaults(handler=_chat)

    db = sub.add_parser("db", help="migrate the policy store's schema")
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    upgrade = db_sub.add_parser("upgrade", help="migrate the schema to this release's (or --revision)")
    upgrade.add_argument("--revision", default="head", help="target revision (default: %(default)s)")
    upgrade.set_defaults(handler=_db_upgrade)
    downgrade = db_sub.add_parser(
        "downgrade", help="migrate the schema back to --revision ('base' drops every table and all data)"
    )
    downgrade.add_argument("--revision", required=True, help="target revision, e.g. 0001 or base")
    downgrade.set_defaults(handler=_db_downgrade)
    current = db_sub.add_parser("current", help="show the schema's revision")
    current.set_defaults(handler=_db_current)
    for command in (upgrade, downgrade, current):
        _add_store_options(command)

    admin = sub.add_parser("admin", help="administer the policy store directly")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)
    rotate = admin_sub.add_parser(
        "rotate-key",
        help="re-encrypt the store's secrets with a new key",
        description=(
            "Add a new key version (to the key file, or from the passphrase with a new salt), make it "
            "active, and re-encrypt every secret in small transactions. Safe while servers run: they "
            "pick the new version up from the key file or the store. Old versions stay in the key file, "
            "to read backups made before the rotation, until --prune."
        ),
    )
    rotate.add_argument("--prune", action="store_true", help="then remove every old key version")
    rotate.add_argument(
        "--new-passphrase",
        action="store_true",
        help="derive the new key from a new passphrase ($INFERFLUX_STORE_NEW_PASSPHRASE, or asked for); "
        "servers must then be restarted with it",
    )
    rotate.add_argument(
        "--batch-size", type=_positive_int, default=200, help="rows per transaction (default: %(default)s)"
    )
    rotate.add_argument("-v", "--verbose", action="store_true", help="report progress per table")
    _add_store_options(rotate)
    rotate.set_defaults(handler=_rotate_key)

    from policy.audit.cli import add_audit_parser  # stdlib only: --help stays fast

    add_audit_parser(sub, store_options=_add_store_options, load_checkpoint=_audit_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except httpx.HTTPError as exc:
        _error(f"cannot reach {getattr(args, 'url', 'the server')}: {exc}")
        return EXIT_FAILURE
    except ClientError as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
