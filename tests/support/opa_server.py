"""An OPA-compatible HTTP server on loopback for tests, answering with the embedded Rego engine (regopy).

It speaks the two parts of OPA's REST API the gateway and tests use:
``PUT /v1/policies/<id>`` (a Rego module as the body) and
``POST /v1/data/<path>`` with ``{"input": ...}``, answered ``{"result": ...}``,
or ``{}`` when the document is undefined — as OPA does. ``delay`` slows every
data answer down, and ``token`` makes it require ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from servers import start_uvicorn, stop_uvicorn

from inferflux.policy.guardrails.rego import load_regopy, prepare_input
from inferflux.policy.guardrails.rego_input import set_input


class LoopbackOpa:
    def __init__(self) -> None:
        self.modules: dict[str, str] = {}
        self.delay = 0.0
        self.token: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.url = ""

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def put_policy(request: Request) -> JSONResponse:
            source = (await request.body()).decode()
            try:
                self._interpreter({**self.modules, request.path_params["id"]: source})
            except Exception as exc:  # noqa: BLE001 - any compile error is the client's
                return JSONResponse({"code": "invalid_parameter", "message": str(exc)[:500]}, status_code=400)
            self.modules[request.path_params["id"]] = source
            return JSONResponse({})

        async def data(request: Request) -> JSONResponse:
            if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
                return JSONResponse({"code": "unauthorized", "message": "bad token"}, status_code=401)
            body = await request.json()
            self.requests.append(body)
            if self.delay:
                await asyncio.sleep(self.delay)
            query = "data." + request.path_params["path"].strip("/").replace("/", ".")
            interpreter = self._interpreter(self.modules)
            prepared = prepare_input(body.get("input"))  # held until the query is done
            set_input(load_regopy(), interpreter, prepared)
            output = interpreter.query(query)
            if not output.ok():
                return JSONResponse({"code": "internal_error", "message": str(output)[:500]}, status_code=500)
            expressions = output.results[0].expressions if output.results else []
            return JSONResponse({"result": expressions[0]} if expressions else {})

        return Starlette(
            routes=[
                Route("/v1/policies/{id:path}", put_policy, methods=["PUT"]),
                Route("/v1/data/{path:path}", data, methods=["POST"]),
            ]
        )

    @staticmethod
    def _interpreter(modules: dict[str, str]) -> Any:
        interpreter = load_regopy().Interpreter()
        for name, source in modules.items():
            interpreter.add_module(f"{name}.rego", source)
        return interpreter


@contextmanager
def running_opa() -> Iterator[LoopbackOpa]:
    opa = LoopbackOpa()
    server, thread, sock, url = start_uvicorn(opa.app())
    opa.url = url
    try:
        yield opa
    finally:
        stop_uvicorn(server, thread, sock)
