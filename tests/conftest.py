"""Shared fixtures (the real default model on the CPU backend, a policy store, and a live
gateway) and the test tiers: which tests ``make test-fast`` leaves out, decided here from
what each test uses (see ``tiers_of``)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _torch_sees_a_gpu() -> bool:
    """``torch.cuda.is_available()``, without importing torch where no GPU device exists.

    torch takes seconds to import; most tests never need it, so it is imported
    only on a machine with an NVIDIA (or ROCm, or WSL) device node, where the
    answer is not already known to be False.
    """
    if not any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return bool(torch.cuda.is_available())


# Without a GPU the Triton kernels (kernels.triton, the CUDA runner) run under
# Triton's interpreter. It must be chosen before any @triton.jit kernel is
# defined, so here, before any test module is collected.
if not _torch_sees_a_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

# Test helpers shared across test packages (the loopback identity provider, ...).
sys.path.insert(0, str(Path(__file__).parent / "support"))

# Fails the run if a secret the suite created (keys, tokens, client secrets) shows in a log record;
# runs the tests marked ``serial`` alone when pytest-xdist spreads the suite over workers (``make test``),
# and hands the workers the longest files first (tests/durations.json).
pytest_plugins = ["secret_watch", "serial_lock", "longest_first"]

# Two workers on two cores, each with torch's default of a thread per core, would run four
# spinning threads on two cores: each worker's torch gets its share (torch is not imported yet).
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))

import oracles  # noqa: E402
from servers import start_uvicorn, stop_uvicorn  # noqa: E402
from services import fresh_schema, service_unavailable  # noqa: E402

DEFAULT_TEST_KV_CACHE_BYTES = 64 * 1024 * 1024

# -- Test tiers ------------------------------------------------------------------
# Four marks (registered in pyproject.toml) name what makes a test costly.
# `make test-fast` runs the tests that carry none of them; `make test` and CI run
# everything. The marks follow from what a test uses, decided here, so that a new
# test lands in its tier without anyone marking it:
#   model        loads the real SmolLM2 model (or transformers' copy of it) or runs a
#                real engine: it uses one of MODEL_FIXTURES
#   service      needs PostgreSQL, Redis or rsyslogd: it uses one of SERVICE_FIXTURES,
#                or is the SERVICE_PARAMS case of a fixture parametrized over backends
#   interpreter  runs Triton kernels, under Triton's interpreter without a GPU: INTERPRETER_PATHS
#   slow         costly for another reason (subprocesses, real time, a compiler run):
#                marked by hand
# A test whose own code or module fixtures load the model, or start a service, is
# marked by hand too (``@pytest.mark.model``, or ``pytestmark = pytest.mark.model``
# in the module, with a comment saying why); a conftest fixture that loads the model
# or reaches a service belongs in the sets below.

MODEL_FIXTURES = frozenset({
    "served_model", "small_batch_model", "live_server", "make_app", "app_for_model",  # this file, gateway/
    "hf_smollm2",  # gateway/conftest.py: transformers' copy of the model
    "hf_causal_lm",  # backends/conftest.py
    "backend_name", "loaded", "oracle_tokens",  # backends/conformance/ (every backend, the model or transformers)
    "mlx_loaded", "cpu_loaded",  # backends/mlx/
    "hf_state_dict", "hf_tokenizer",  # backends/models/
})
SERVICE_FIXTURES = frozenset({"pg_server", "redis_server", "rsyslog"})
# (fixture, param) of fixtures that fetch a service's fixture by name (``request.getfixturevalue``).
SERVICE_PARAMS = frozenset({("store_settings", "postgresql"), ("backend", "redis"), ("receiver_kind", "rsyslog-tcp")})
INTERPRETER_PATHS = ("kernels/test_kernels_triton.py", "backends/cuda/")
TESTS_DIR = Path(__file__).parent


def tiers_of(item: pytest.Item) -> set[str]:
    """The tier marks ``item`` gets from the fixtures it uses, its parameters and its path."""
    used = set(getattr(item, "fixturenames", ()))
    params: dict[str, object] = getattr(getattr(item, "callspec", None), "params", {})
    tiers = set()
    if used & MODEL_FIXTURES:
        tiers.add("model")
    if used & SERVICE_FIXTURES or any(params.get(name) == value for name, value in SERVICE_PARAMS):
        tiers.add("service")
    if item.path.relative_to(TESTS_DIR).as_posix().startswith(INTERPRETER_PATHS):
        tiers.add("interpreter")
    return tiers


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for tier in sorted(tiers_of(item)):
            item.add_marker(tier)


# The fixtures that build transformers' copy of a model, the tests' oracle (tests/support/oracles.py).
ORACLE_FIXTURES = frozenset({"hf_smollm2", "hf_causal_lm", "hf_state_dict", "hf_tokenizer", "oracle_tokens"})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test that compared against an oracle says which version it was written against."""
    report = yield
    if report.failed:
        used = set(oracles.used_by(item))
        if set(getattr(item, "fixturenames", ())) & ORACLE_FIXTURES:
            used |= {name for name in oracles.ORACLES if name in sys.modules}
        for name in sorted(used):
            report.sections.append(("oracle", oracles.describe(name)))
    return report


# PostgreSQL tests each get a schema of their own (``search_path`` set through
# the connection's options) and drop it afterwards, so they leave nothing
# behind. The server is ``$INFERFLUX_TEST_PG_URL`` or postgres@127.0.0.1:5432/test;
# if it is down the tests are skipped, except under CI (``$CI`` set), where
# that is a failure.
PG_URL = os.environ.get("INFERFLUX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The test PostgreSQL's URL, once it answered."""
    from sqlalchemy import create_engine, pool
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    engine = create_engine(PG_URL, poolclass=pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        service_unavailable(f"PostgreSQL at {make_url(PG_URL).render_as_string()} is unreachable ({exc.orig})",
                            "PostgreSQL")
    finally:
        engine.dispose()
    return PG_URL


# Redis: ``$INFERFLUX_TEST_REDIS_URL`` or 127.0.0.1:6379/0, skipped when down except under CI.
REDIS_URL = os.environ.get("INFERFLUX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The test Redis's URL, once it answered a PING."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        service_unavailable(f"Redis at {REDIS_URL} is unreachable ({exc})", "Redis")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A URL whose connections see only a fresh schema, dropped after the test (a module's: ``fresh_schema``)."""
    with fresh_schema(pg_server) as url:
        yield url


@pytest.fixture(scope="session")
def served_model() -> Iterator[object]:
    """SmolLM2-135M-Instruct (the bundled default) on the cpu backend, float32, 64 MiB of KV."""
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.models import default_model_path

    from inferflux.gateway.models.served import load_served_model
    from inferflux.gateway.settings import DEFAULT_MODEL_NAME

    spec = ModelSpec(
        name=DEFAULT_MODEL_NAME,
        path=default_model_path(),
        dtype="float32",
        aliases=("smollm2",),
    )
    model = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=DEFAULT_TEST_KV_CACHE_BYTES))
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def hf_oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``hf_oracle`` keeps transformers' copy of the model for this run (its xdist workers share it)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-oracle"


@pytest.fixture(scope="session")
def gateway_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data directory of the session's gateway (SQLite store and its key file)."""
    return tmp_path_factory.mktemp("gateway-data")


@pytest.fixture(scope="session")
def gateway_store(gateway_data_dir: Path) -> Iterator[Any]:
    """The session's policy store (SQLite under ``gateway_data_dir``), bootstrapped."""
    from inferflux.gateway.settings import Settings
    from inferflux.policy.store import PolicyStore

    settings = Settings(data_dir=gateway_data_dir)
    store = PolicyStore.open(settings.store, settings.data_dir)
    yield store
    store.close()


@pytest.fixture(scope="session")
def admin_key(gateway_store: Any) -> str:
    """A platform-admin API key of ``gateway_store``: the bootstrap key printed on first start."""
    key = gateway_store.ensure_bootstrap_admin()
    assert key is not None, "the session store was bootstrapped twice"
    return str(key)


@pytest.fixture(scope="session")
def auth_headers(admin_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {admin_key}"}


def build_app(served_model: Any, store: Any, authenticator: Any = None, **settings: Any) -> Any:
    """An app serving the session model from ``store``; the engine stays the session's."""
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    manager = ModelManager(expected=[served_model.name])
    manager.add(served_model)
    # Each app its own data directory (audit spool, rate-limit state), never the user's.
    settings.setdefault("data_dir", tempfile.mkdtemp(prefix="inferflux-app-"))
    return create_app(Settings(**settings), manager, store=store, authenticator=authenticator, owns_models=False)


@pytest.fixture(scope="session")
def make_app(served_model: Any) -> Any:
    """``make_app(store, authenticator=None, **settings)``: an app serving the session model from ``store``."""
    return lambda store, authenticator=None, **settings: build_app(served_model, store, authenticator, **settings)


@pytest.fixture(scope="session")
def app_for_model() -> Any:
    """``app_for_model(model, store, **settings)``: like ``make_app``, for a model other than the session's."""
    return build_app


@pytest.fixture(scope="session")
def live_server(served_model: object, gateway_store: Any, admin_key: str) -> Iterator[str]:
    """The gateway serving ``served_model`` over a real socket; yields its base URL.

    Every route but the probes needs credentials: use ``admin_key`` / ``auth_headers``.
    """
    server, thread, sock, url = start_uvicorn(build_app(served_model, gateway_store))
    try:
        yield url
    finally:
        stop_uvicorn(server, thread, sock)
