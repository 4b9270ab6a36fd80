"""``inferctl served-models``: the models a running server serves and loads (``/admin/v1/models``, platform admin).

``load`` registers a model with every replica (it loads in the background:
``show`` follows its progress); ``--upstream`` serves it from OpenAI-compatible
servers elsewhere instead of weights here, held to the server's ``upstreams``
settings (its endpoints to ``allowed_hosts``, public addresses only without it;
``api_key_env`` to the ``INFERFLUX_UPSTREAM_`` prefix; ``ca_file`` to ``ca_dir``; a
credential or variable it names must exist: a 422 names the field otherwise); ``--pooling``, ``--no-normalize``,
``--matryoshka`` and ``--token-ids`` are its ``embedding`` section (how it answers
/v1/embeddings), as a configuration file's ``models[].embedding``;
``--deterministic`` loads it with batch-invariant kernels (``models[].deterministic``);
``--quantise``, ``--gemm-from`` and ``--no-pack`` are its load ``passes`` (``models[].passes``). ``unload``
takes it out of the registry, ``default`` makes it the default model.
(``inferctl models`` lists what a caller may use, through the OpenAI API.)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from inferflux.backends.base import POOLINGS
from inferflux.gateway.cli.client import add_client_options, admin_call, show
from inferflux.gateway.cli.common import EXIT_FAILURE, EXIT_OK, ClientError
from inferflux.gateway.cli.progress import Progress

POLL_SECONDS = 0.5

_COLUMNS = ("id", "status", "backend", "dtype", "deterministic", "default", "source", "aliases")
_PATH = "/models"


def _upstream(value: str | None) -> dict[str, Any] | None:
    """``--upstream``: the section as JSON, inline or ``@file``."""
    if value is None:
        return None
    try:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as handle:
                value = handle.read()
        section = json.loads(value)
    except (OSError, ValueError) as exc:
        raise ClientError(f"--upstream takes a JSON object, inline or as @file: {exc}") from None
    if not isinstance(section, dict):
        raise ClientError("--upstream takes a JSON object, e.g. '{\"endpoints\": [\"http://10.0.0.5:8000/v1\"]}'")
    return section


def _embedding(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``embedding`` section from the flags given; None when none was."""
    section = {"pooling": args.pooling, "normalize": args.normalize, "matryoshka": args.matryoshka,
               "token_ids": args.token_ids}
    given = {name: value for name, value in section.items() if value is not None}
    return given or None


def _passes(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``passes`` section from the flags given; None when none was (the server's engine.passes)."""
    section = {"quantise": args.quantise, "gemm_from": args.gemm_from, "pack": args.pack,
               "decode_loop": args.decode_loop}
    given = {name: value for name, value in section.items() if value is not None}
    return given or None


def _load_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"name": args.name, "aliases": args.alias or [], "default": args.default}
    optional = {"path": args.path, "backend": args.backend, "dtype": args.dtype, "upstream": _upstream(args.upstream),
                "embedding": _embedding(args), "deterministic": args.deterministic,
                "passes": _passes(args)}  # fmt: skip
    return {**body, **{name: value for name, value in optional.items() if value is not None}}


def wait_for_load(args: argparse.Namespace, record: dict[str, Any]) -> dict[str, Any]:
    """Poll a loading model until it is ready or failed; its stage on a progress line (stderr, a terminal only)."""
    with Progress(f"loading {record['id']}", enabled=not args.json) as progress:
        while record.get("status") == "loading":
            progress.update(f"{record.get('stage', '')} ({record.get('elapsed_seconds', 0):.0f} s)")
            time.sleep(POLL_SECONDS)
            record = admin_call(args, "GET", f"{_PATH}/{args.name}")
        progress.update(str(record.get("status")))
    return record


def _served_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        return show(args, admin_call(args, "GET", _PATH)["data"], _COLUMNS)
    if args.action == "load":
        record = admin_call(args, "POST", _PATH, _load_body(args))
        if args.wait:
            record = wait_for_load(args, record)
        show(args, record, _COLUMNS)
        return EXIT_FAILURE if record.get("status") == "failed" else EXIT_OK
    if args.action == "show":
        return show(args, admin_call(args, "GET", f"{_PATH}/{args.model}"), _COLUMNS)
    if args.action == "default":
        return show(args, admin_call(args, "POST", f"{_PATH}/{args.model}/default"), _COLUMNS)
    admin_call(args, "DELETE", f"{_PATH}/{args.model}")
    if args.json:
        print(json.dumps({"id": args.model, "unloaded": True}))
    else:
        print(f"unloaded model {args.model}")
    return EXIT_OK


def _add_embedding_flags(load: argparse.ArgumentParser) -> None:
    """``load``'s flags of the model's ``embedding`` section."""
    load.add_argument("--pooling", choices=POOLINGS, help="embedding: pool the final hidden states by "
                      "their mean or the last token's (default: mean)")  # fmt: skip
    load.add_argument("--no-normalize", dest="normalize", action="store_const", const=False,
                      help="embedding: leave vectors unnormalised (default: unit L2 norm)")  # fmt: skip
    load.add_argument("--matryoshka", action="store_const", const=True,
                      help="embedding: the model is trained so that a prefix of its vector is an embedding "
                      "(requests may ask for fewer dimensions)")  # fmt: skip
    load.add_argument("--token-ids", action="store_const", const=True,
                      help="embedding: take token-id inputs, read as this model's own ids (default: refused, "
                      "since clients such as LangChain's OpenAIEmbeddings send OpenAI's)")  # fmt: skip


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "served-models"
) -> argparse.ArgumentParser:
    """Add ``served-models list|load|show|unload|default`` to ``inferctl``'s subcommands."""
    parser = subparsers.add_parser(
        name,
        help="load, list and unload a running server's models (platform admin)",
        description=__doc__.split("\n\n", 1)[1].replace("``", "'"),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="the served and loading models, with their status")
    load = actions.add_parser("load", help="load a model on every replica (in the background)")
    load.add_argument("name", help="the model's name (letters, digits, . _ : -)")
    load.add_argument("--path", help="a GGUF file or a safetensors directory on the server")
    load.add_argument("--upstream", metavar="JSON", help="serve it from upstream servers: the upstream section as "
                      "JSON, inline or @file (endpoints, model, credential or api_key_env, ...), held to the "
                      "server's upstreams settings: endpoints in upstreams.allowed_hosts (without it, public "
                      "addresses only), api_key_env under the INFERFLUX_UPSTREAM_ prefix, ca_file under "
                      "upstreams.ca_dir, a credential that exists")  # fmt: skip
    load.add_argument("--backend", help="a registered backend (default: the server's)")
    load.add_argument("--dtype", choices=("auto", "float32", "bfloat16"))
    load.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                      help="batch-invariant kernels (cpu backend): the same logits alone or batched, at a "
                      "throughput cost (default: the server's engine.deterministic)")  # fmt: skip
    load.add_argument("--quantise", choices=("auto", "blocks", "native", "hybrid", "exact", "int8", "int4", "bf16", "f32"),
                      help="load pass (cpu backend): blocks keeps only the GGUF file's own blocks and multiplies "
                      "them exactly at every batch size (auto's choice below AVX-512), native keeps the blocks with "
                      "int8 activations, hybrid those and "
                      "the dense weights for batches, exact those and the dense weights with small batches multiplied by "
                      "the weights' own bfloat16 or float32 values (auto's choice on AVX-512), int8/int4 re-quantise, "
                      "bf16/f32 stay dense (default: the "
                      "server's engine.passes, else auto)")  # fmt: skip
    load.add_argument("--gemm-from", type=int, metavar="ROWS",
                      help="load pass: rows in a step from which quantised projections use the GEMM path")
    load.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                      help="load pass (cpu backend): bfloat16 dense weights packed once for oneDNN, a copy beside "
                      "each (default: the server's engine.passes, else packed)")  # fmt: skip
    load.add_argument("--decode-loop", action=argparse.BooleanOptionalAction, default=None,
                      help="load pass (cpu backend): decode steps run every layer in one C++ call, with the "
                      "Python path's bits (default: the server's engine.passes, else on)")  # fmt: skip
    load.add_argument("--alias", action="append", metavar="NAME", help="another name for it (repeatable)")
    load.add_argument("--default", action="store_true", help="make it the default model once loaded")
    load.add_argument("--wait", action="store_true", help="wait until it is ready (a progress line on a terminal); "
                      "exit status 1 if it fails")  # fmt: skip
    _add_embedding_flags(load)
    for action, text in (("show", "a model's status and load progress"), ("unload", "unload a model and forget it"),
                         ("default", "make a model the default")):  # fmt: skip
        actions.add_parser(action, help=text).add_argument("model", help="the model's name")
    for sub in actions.choices.values():
        add_client_options(sub)
        sub.add_argument("--json", action="store_true", help="print the raw response")
    parser.set_defaults(handler=_served_models)
    return parser
