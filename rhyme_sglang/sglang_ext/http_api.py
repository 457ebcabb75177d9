"""HTTP additions to SGLang's FastAPI app: request validation and the ``/rhyme/*`` routes.

Routes (JSON in, JSON out; 4xx with ``{"error": {"message": ...}}`` on bad input):

* ``POST /rhyme/rewards`` ``{"rewards": [{"rid", "reward"} | {"prompt_id", "sample", "reward"}]}``
* ``POST /rhyme/advance_epoch`` -> ``{"epoch"}``
* ``GET  /rhyme/stats`` -> tau per epoch, acceptance histogram, drafted/accepted, memory, latency
* ``POST /rhyme/save`` / ``POST /rhyme/load`` ``{"path"}`` (inside ``--rhyme-snapshot-dir``);
  ``POST /rhyme/reset``
* ``GET /rhyme/history?prompt_id=P`` -> the prompt's history; ``POST /rhyme/history``
  ``{"history": <that>, "replace": false}`` adds it to this engine -> ``{"added", "num_responses"}``
* ``POST /rhyme/histories`` ``{"prompt_ids": [P, ...]}`` -> the held prompts' histories (a list);
  ``POST /rhyme/drop_history`` ``{"prompt_ids": [P, ...]}`` -> ``{"dropped", "busy",
  "num_prompts", "memory_bytes"}`` (prompts with a request in flight are kept, listed in ``busy``)
* ``POST /rhyme/draft`` ``{"prompt", "context", "max_tokens", "prompt_id"}`` -> the draft the
  history would propose after ``prompt + context`` (inspection; changes no history)
* ``GET /rhyme/schedule_policy`` -> ``{"policy"}``; ``POST /rhyme/schedule_policy`` ``{"policy"}``
  switches the waiting-queue order (``lpt`` | ``fcfs``) at run time (admin)
* ``GET|POST /rhyme/predict_lengths`` ``{"prompts": [[ids...] | "prompt_id", ...]}`` -> ``{"lengths"}``

The POST routes but the read-only ``predict_lengths`` and ``histories`` are admin routes: they
require SGLang's admin key (or the API key when only that is set), like SGLang's own
weight-update endpoints; with no key set they answer loopback clients only (403 otherwise).
"""

from __future__ import annotations

import ipaddress
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


def is_loopback(host) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except (TypeError, ValueError):
        return host == "localhost"


def make_routes(client, snapshot_root: str, keyless_admin: bool, rhyme: bool = True):
    """Handlers bound to one engine's control client (``None``: no control channel).

    ``rhyme``: the engine runs RHYME; otherwise its scheduler serves only the time breakdown,
    and every other ``/rhyme/*`` route answers 404. ``keyless_admin``: no admin/API key is
    set, so admin routes answer loopback clients only."""
    from rhyme_sglang.sglang_ext.control import ControlError
    from rhyme_sglang.sglang_ext.snapshot_paths import confine

    def snapshot(body: dict, must_exist: bool) -> dict:
        return dict(body, path=confine(body.get("path"), snapshot_root, must_exist=must_exist))

    async def call(request: Request, cmd: str, fields: tuple = (), optional: tuple = (),
                   admin: bool = False, prepare=None, any_mode: bool = False):
        if admin and keyless_admin and not is_loopback(getattr(request.client, "host", None)):
            return _error(403, "admin routes answer loopback clients only when no "
                               "--admin-api-key is set")
        if client is None or not (rhyme or any_mode):
            return _error(404, "RHYME is not enabled on this server (--speculative-algorithm RHYME)")
        try:
            body = await _json_body(request)
            if request.method == "GET" and not body:
                body = _query_body(request, fields)
            unknown = sorted(set(body) - set(fields) - set(optional))
            if unknown:
                raise ValueError(f"unknown field(s) {unknown}; expected {list(fields + optional)}")
            missing = [f for f in fields if f not in body]
            if missing:
                raise ValueError(f"missing field(s) {missing}")
            if prepare is not None:
                body = prepare(body)
            result = await run_in_threadpool(client.call, cmd, **body)
        except (ValueError, ControlError) as exc:  # json.JSONDecodeError is a ValueError
            return _error(400, str(exc))
        except TimeoutError as exc:
            return _error(503, str(exc))
        return JSONResponse(result)

    def admin(cmd, fields=(), **kw):
        return lambda r: call(r, cmd, fields, admin=True, **kw)

    return {
        ("POST", "/rhyme/rewards", True): admin("set_rewards", ("rewards",)),
        ("POST", "/rhyme/advance_epoch", True): admin("advance_epoch"),
        ("GET", "/rhyme/stats", False): lambda r: call(r, "stats"),
        # every mode: where the scheduler's time went; POST {"reset": true} starts a new window
        ("GET", "/rhyme/breakdown", False): lambda r: call(r, "breakdown", any_mode=True),
        ("POST", "/rhyme/breakdown", True): admin("breakdown", optional=("reset",), any_mode=True),
        ("POST", "/rhyme/save", True): admin("save", ("path",), prepare=lambda b: snapshot(b, False)),
        ("POST", "/rhyme/load", True): admin("load", ("path",), prepare=lambda b: snapshot(b, True)),
        ("POST", "/rhyme/reset", True): admin("reset"),
        ("GET", "/rhyme/history", False): lambda r: call(r, "export_history", ("prompt_id",)),
        ("POST", "/rhyme/history", True): admin("import_history", ("history",), optional=("replace",)),
        ("POST", "/rhyme/histories", False): lambda r: call(r, "export_histories", ("prompt_ids",)),
        ("POST", "/rhyme/drop_history", True): admin("drop_history", ("prompt_ids",)),
        ("POST", "/rhyme/draft", True): admin("draft", ("prompt",),
                                              optional=("context", "max_tokens", "prompt_id")),
        ("GET", "/rhyme/schedule_policy", False): lambda r: call(r, "schedule_policy"),
        ("POST", "/rhyme/schedule_policy", True): admin("schedule_policy", ("policy",)),
        ("GET", "/rhyme/predict_lengths", False): lambda r: call(r, "predict_lengths", ("prompts",)),
        ("POST", "/rhyme/predict_lengths", False): lambda r: call(r, "predict_lengths", ("prompts",)),
    }


def _query_body(request: Request, fields: tuple) -> dict:
    """GET parameters: ``prompts`` is JSON, other fields are plain strings."""
    query = request.query_params
    body = {f: query[f] for f in fields if f in query}
    if "prompts" in body:
        body["prompts"] = json.loads(body["prompts"])
    return body


def install(control_addr: Optional[str] = None, snapshot_root: Optional[str] = None,
            keyless_admin: bool = False, rhyme: bool = True) -> None:
    """Add validation middleware and ``/rhyme/*`` routes to sglang's app (once)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from rhyme_sglang.sglang_ext.config import RhymeConfig
    from rhyme_sglang.sglang_ext.control import ControlClient
    from rhyme_sglang.sglang_ext.validation import (
        RequestValidationMiddleware,
        install_token_id_check,
    )

    install_token_id_check()
    http_server.app.add_middleware(RequestValidationMiddleware)
    client = ControlClient(control_addr) if control_addr else None
    root = snapshot_root or RhymeConfig().snapshot_root()
    for (method, path, admin), handler in make_routes(client, root, keyless_admin, rhyme).items():
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
