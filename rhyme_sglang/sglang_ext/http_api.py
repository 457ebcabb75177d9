"""HTTP additions to SGLang's FastAPI app: request validation and the ``/rhyme/*`` routes.

Routes (JSON in, JSON out; 4xx with ``{"error": {"message": ...}}`` on bad input):

* ``POST /rhyme/rewards`` ``{"rewards": [{"rid", "reward"} | {"prompt_id", "sample", "reward"}]}``
* ``POST /rhyme/advance_epoch`` -> ``{"epoch"}``
* ``GET  /rhyme/stats`` -> tau per epoch, acceptance histogram, drafted/accepted, memory, latency
* ``POST /rhyme/save`` / ``POST /rhyme/load`` ``{"path"}``; ``POST /rhyme/reset``
* ``GET /rhyme/schedule_policy`` -> ``{"policy"}``; ``POST /rhyme/schedule_policy`` ``{"policy"}``
  switches the waiting-queue order (``lpt`` | ``fcfs``) at run time (admin)
* ``GET|POST /rhyme/predict_lengths`` ``{"prompts": [[ids...] | "prompt_id", ...]}`` -> ``{"lengths"}``

Rewards, epoch, save/load/reset are admin endpoints: they require SGLang's admin key (or the
API key when only that is set), like SGLang's own weight-update endpoints.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)
_INSTALLED = False


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def make_routes(client):
    """Handlers bound to one engine's control client (``None`` when RHYME is off)."""
    from rhyme_sglang.sglang_ext.control import ControlError

    async def call(request: Request, cmd: str, fields: tuple = ()):
        if client is None:
            return _error(404, "RHYME is not enabled on this server (--speculative-algorithm RHYME)")
        try:
            body = await _json_body(request)
            if request.method == "GET" and not body and "prompts" in request.query_params:
                body = {"prompts": json.loads(request.query_params["prompts"])}
            unknown = sorted(set(body) - set(fields))
            if unknown:
                raise ValueError(f"unknown field(s) {unknown}; expected {list(fields)}")
            missing = [f for f in fields if f not in body]
            if missing:
                raise ValueError(f"missing field(s) {missing}")
            result = await run_in_threadpool(client.call, cmd, **body)
        except (ValueError, ControlError) as exc:  # json.JSONDecodeError is a ValueError
            return _error(400, str(exc))
        except TimeoutError as exc:
            return _error(503, str(exc))
        return JSONResponse(result)

    return {
        ("POST", "/rhyme/rewards", True): lambda r: call(r, "set_rewards", ("rewards",)),
        ("POST", "/rhyme/advance_epoch", True): lambda r: call(r, "advance_epoch"),
        ("GET", "/rhyme/stats", False): lambda r: call(r, "stats"),
        ("POST", "/rhyme/save", True): lambda r: call(r, "save", ("path",)),
        ("POST", "/rhyme/load", True): lambda r: call(r, "load", ("path",)),
        ("POST", "/rhyme/reset", True): lambda r: call(r, "reset"),
        ("GET", "/rhyme/schedule_policy", False): lambda r: call(r, "schedule_policy"),
        ("POST", "/rhyme/schedule_policy", True): lambda r: call(r, "schedule_policy", ("policy",)),
        ("GET", "/rhyme/predict_lengths", False): lambda r: call(r, "predict_lengths", ("prompts",)),
        ("POST", "/rhyme/predict_lengths", False): lambda r: call(r, "predict_lengths", ("prompts",)),
    }


def install(control_addr: Optional[str] = None) -> None:
    """Add validation middleware and ``/rhyme/*`` routes to sglang's app (once)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from rhyme_sglang.sglang_ext.control import ControlClient
    from rhyme_sglang.sglang_ext.validation import (
        RequestValidationMiddleware,
        install_token_id_check,
    )

    install_token_id_check()
    http_server.app.add_middleware(RequestValidationMiddleware)
    client = ControlClient(control_addr) if control_addr else None
    for (method, path, admin), handler in make_routes(client).items():
        endpoint = _named(handler, path, method)
        if admin:
            endpoint = auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint)
        http_server.app.add_api_route(path, endpoint, methods=[method])
    _INSTALLED = True


def _named(handler, path: str, method: str):
    async def endpoint(request: Request):
        return await handler(request)

    endpoint.__name__ = f"rhyme_{method.lower()}_{path.rsplit('/', 1)[-1]}"
    return endpoint
