"""The operator's commands: ``inferctl serve`` (load the models, serve the API) and ``inferctl backends``.

The engine, the backends and the store are imported when ``serve`` runs, not
when this module is: ``--help`` and the client commands do not need them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from inferflux.gateway.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, print_error
from inferflux.gateway.settings import ConfigError, Settings, ensure_data_dir, load_settings
from inferflux.policy.errors import StoreConfigError

if TYPE_CHECKING:
    from inferflux.backends.base import ModelSpec
    from inferflux.gateway.models.served import ModelManager
    from inferflux.policy.store import PolicyStore


def _serve(args: argparse.Namespace) -> int:
    settings = _serve_settings(args)
    if isinstance(settings, int):
        return settings  # the exit status of settings that did not load
    _configure_logs(settings)

    # Imported here: loading pulls in the engine and backends, which --help and
    # the client commands do not need.
    from inferflux.gateway import drain
    from inferflux.gateway.app import create_app
    from inferflux.gateway.logs import redaction as log_redaction
    from inferflux.gateway.slowclients import server_options
    from inferflux.gateway.tracing import TracingConfigError

    # The store first: a wrong key or an unreachable database should fail in
    # a second, not after the models have loaded.
    store = _open_store(settings)
    if store is None:
        return EXIT_FAILURE
    loaded = _load_models(settings, store)
    if loaded is None:
        store.close()
        return EXIT_FAILURE
    manager, configured = loaded

    # The app closes the store at shutdown: uvicorn re-raises the signal that
    # stopped it, so nothing after uvicorn.run() is sure to run.
    try:
        app = create_app(settings, manager, store=store, owns_store=True, configured_models=configured)
    except TracingConfigError as exc:  # an OTEL_* variable asks for what is not installed
        print_error(str(exc))
        manager.shutdown()
        store.close()
        return EXIT_FAILURE
    drain.serve(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=log_redaction.log_config(settings.log_format),
        # SIGTERM: readiness fails, new requests get 503, requests in flight get this long.
        grace=settings.server.shutdown_grace_seconds,
        # Slow clients: header, write and keep-alive deadlines (the body's is a middleware of the app).
        **server_options(settings.input_limits, settings.server.stream_write_timeout_seconds, settings.websocket),
    )
    return EXIT_OK


def _serve_settings(args: argparse.Namespace) -> Settings | int:
    """The settings from the flags, the environment and the file, the data directory made; else the exit status."""
    from inferflux.backends.cpu.runtime import choose_isa  # loads no torch: a bad flag still fails at once

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
                "registry.path": args.registry_path,
                "registry.poll_interval_seconds": args.registry_poll_interval,
                "max_body_bytes": args.max_body_bytes,
                "websocket.enabled": args.websocket,
            },
        )
        ensure_data_dir(settings.data_dir)
        choose_isa(settings.runtime.cpu_isa)
    except ConfigError as exc:
        print_error(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        print_error(f"cannot create the data directory: {exc}")
        return EXIT_FAILURE
    return settings


def _configure_logs(settings: Settings) -> None:
    """Log lines as the settings ask (text or JSON), none with a credential in it."""
    from inferflux.gateway.logs import redaction as log_redaction
    from inferflux.gateway.logs import structured as structured_logs

    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    structured_logs.configure(settings.log_format, level)  # text, or one JSON object a line
    log_redaction.install()  # no credential reaches a log line (the access log prints query strings)


def _open_store(settings: Settings) -> PolicyStore | None:
    """The policy store, its bootstrap admin key made (and shown) on first start; None, said why, if it cannot open."""
    from inferflux.policy.store import PolicyStore

    try:
        store = PolicyStore.open(settings.store, settings.data_dir)
        admin_key = store.ensure_bootstrap_admin(os.environ.get("INFERFLUX_BOOTSTRAP_ADMIN_KEY"))
    except StoreConfigError as exc:
        print_error(str(exc))
        return None
    except Exception as exc:  # the driver's: connection refused, authentication failed, ...
        print_error(f"cannot open the policy store: {getattr(exc, 'orig', None) or exc}")
        return None
    if admin_key is not None:
        _announce_admin_key(admin_key)
    return store


def _load_models(settings: Settings, store: PolicyStore) -> tuple[ModelManager, set[str]] | None:
    """The configured models loaded, then those loaded over the admin API before the restart; and the
    configured names. None (said why, every model stopped) when a configured model does not load."""
    from inferflux.backends.base import BackendError
    from inferflux.gateway.models.admin import ModelAdmin
    from inferflux.gateway.models.served import ModelManager, engine_config_from, load_served_model
    from inferflux.gateway.models.upstreams import egress_policy, upstream_key

    specs = settings.model_specs()
    manager = ModelManager(expected=[spec.name for spec, _ in specs])
    egress = egress_policy(settings)  # where upstream models may connect
    for spec, backend in specs:
        try:
            config = engine_config_from(settings.engine, settings.model_speculative(spec.name))
            key = upstream_key(store, spec.upstream, settings, egress)
            manager.add(load_served_model(spec, backend, config, priority=settings.runtime.backend_priority,
                                          upstream_key=key, egress=egress))  # fmt: skip
        except (BackendError, OSError, ValueError) as exc:
            where = "upstream" if spec.upstream is not None else spec.path
            print_error(f"cannot load model {spec.name!r} ({where}) on backend {backend!r}: {exc}")
            manager.shutdown()
            return None
    configured = {spec.name for spec, _ in specs}
    # Models loaded over the admin API before the restart; one that fails to load is logged and skipped.
    ModelAdmin(manager, store, settings, configured).restore()
    return manager, configured


def _backends(args: argparse.Namespace) -> int:
    from inferflux.backends import registry
    from inferflux.backends.base import BackendError
    from inferflux.backends.cpu.runtime import choose_isa

    settings = load_settings(args.config)
    choose_isa(settings.runtime.cpu_isa)
    priority = settings.runtime.backend_priority
    try:
        chain = registry.configured_priority(priority)
        statuses = registry.statuses(priority=chain)
    except BackendError as exc:  # a malformed INFERFLUX_BACKEND_PRIORITY
        raise ConfigError(str(exc)) from None
    # The chain's first available backend: the one 'serve' takes for "auto".
    # A remote backend serves only models with an upstream section: "auto" never takes it.
    chosen = next((s.name for s in statuses if s.name in chain and s.available and s.kind == "engine"), None)
    if args.json:
        print(json.dumps({
            "backends": [{**vars(s), "priority": chain.index(s.name) + 1 if s.name in chain else None}
                         for s in statuses],
            "priority": list(chain),
            "auto": chosen,
            # What each configured model asks of its backend at load (the admin API's models: GET /admin/v1/models,
            # with what the passes did and the weight bytes before and after, once loaded).
            "models": [{"name": spec.name, "backend": backend, "dtype": spec.dtype,
                        "deterministic": spec.deterministic, "passes": dict(spec.passes or {}),
                        **_pass_plan(spec, backend, chosen)}
                       for spec, backend in settings.model_specs() if spec.upstream is None],
        }, indent=2))
        return EXIT_OK
    rows = [("BACKEND", "KIND", "PRIORITY", "AVAILABLE", "PROVIDED BY", "REASON")]
    for s in statuses:
        available = "yes" if s.available else ("blocked" if not s.allowed else "no")
        rank = str(chain.index(s.name) + 1) if s.name in chain else "-"
        rows.append((s.name, s.kind, rank, available, s.provider or "-", s.reason or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])
    print(f"\nauto: {chosen or 'nothing in the priority chain can run here'} (priority: {', '.join(chain)})")
    return EXIT_OK


def _pass_plan(spec: ModelSpec, backend: str, chosen: str | None) -> dict[str, Any]:
    """The cpu backend's load passes for a model it would serve: the pipeline and the mode they resolve to."""
    if (chosen if backend == "auto" else backend) != "cpu":
        return {}
    from inferflux.backends.cpu import passes
    from inferflux.backends.cpu.backend import resolve_dtype

    return {"pass_plan": passes.plan(spec.passes, spec.dtype, spec.path, resolve_dtype)}


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



def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` and ``backends`` to ``inferctl``'s commands."""
    _add_serve(sub)
    _add_backends(sub)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    serve.add_argument(
        "--registry-path",
        metavar="DIR",
        help="a directory of model manifests (one YAML file a model, the keys of a models: entry), polled: a file "
        "added, changed or removed loads, reloads or drains its model without a restart (default: none; "
        "env: INFERFLUX_REGISTRY_PATH)",
    )
    serve.add_argument(
        "--registry-poll-interval",
        metavar="SECONDS",
        type=float,
        help="how often --registry-path is read, 0.1 at least (default: 5; env: INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS)",
    )
    _add_server_arguments(serve)
    serve.set_defaults(handler=_serve)


def _add_server_arguments(serve: argparse.ArgumentParser) -> None:
    """``serve``'s flags for the server itself rather than its models: address, state, memory, limits, logs."""
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
        "--no-websocket",
        dest="websocket",
        action="store_const",
        const=False,
        help="do not serve /v1/websocket, several streamed requests on one WebSocket connection (default: served; "
        "its limits are the websocket section of the config; env: INFERFLUX_WEBSOCKET)",
    )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log verbosity (default: info; env: INFERFLUX_LOG_LEVEL)",
    )


def _add_backends(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
