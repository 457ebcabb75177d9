"""Request validation in front of SGLang: malformed input gets a clear 4xx, never a crash.

Two layers:
* :class:`RequestValidationMiddleware` (HTTP): a ``/generate`` body passes when SGLang's own
  contract gate (``sglang.srt.entrypoints.api_contract.generate_contract_error``) admits it,
  and its values cannot crash or corrupt anything: ``max_new_tokens`` >= 0 and well-formed
  ``custom_params``. Top-level fields SGLang does not know (``model``, which sglang-router
  adds, and others) are ignored as SGLang ignores them, and logged once per name.
* :func:`install_token_id_check` (tokenizer manager, so HTTP and ``Engine`` alike): every
  input token id must be an int in ``[0, vocab_size)``; sglang 0.5.23 otherwise lets an
  out-of-vocabulary id reach the model and the scheduler process dies. RHYME's
  ``custom_params`` (``rhyme_prompt_id``: non-empty str, ``rhyme_sample``: int >= 0,
  ``rhyme_run_ahead``: bool, true only with a ``rhyme_prompt_id``) are checked in both layers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)
_VALIDATED_PATHS = ("/generate",)
_LOGGED_UNKNOWN: set = set()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


@functools.lru_cache(maxsize=1)
def _known_fields() -> frozenset:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return frozenset(f.name for f in dataclasses.fields(GenerateReqInput))


def _log_unknown_once(body: dict) -> None:
    new = sorted(set(body) - _known_fields() - _LOGGED_UNKNOWN)
    if new:
        _LOGGED_UNKNOWN.update(new)
        logger.info("/generate: ignoring field(s) %s that SGLang does not use (logged once)", new)


def check_generate_body(body) -> str | None:
    """Return an error message for a malformed ``/generate`` body, or None if it is fine."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    if not isinstance(body, dict):
        return f"request body must be a JSON object, got {type(body).__name__}"
    contract = generate_contract_error(body)
    if contract is not None:
        return f"invalid /generate request: {contract}"
    _log_unknown_once(body)
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        if p is None:
            continue
        if not isinstance(p, dict):
            return f"sampling_params must be an object, got {type(p).__name__}"
        mnt = p.get("max_new_tokens")
        if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 0):
            return f"max_new_tokens must be a non-negative integer, got {mnt!r}"
        try:
            check_rhyme_params(p)
        except ValueError as exc:
            return str(exc)
    return None


class RequestValidationMiddleware(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        if request.method == "POST" and request.url.path in _VALIDATED_PATHS:
            raw = await request.body()
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return _error(400, f"request body is not valid JSON: {exc}")
            problem = check_generate_body(body)
            if problem is not None:
                return _error(400, problem)
        return await call_next(request)


def check_rhyme_params(sampling_params) -> None:
    """Raise ``ValueError`` for malformed RHYME keys in ``sampling_params["custom_params"]``."""
    custom = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    if custom is None:
        return
    if not isinstance(custom, dict):
        raise ValueError(f"custom_params must be an object, got {type(custom).__name__}")
    for key in _RHYME_KEYS:
        _check_rhyme_value(key, custom.get(key))
    if custom.get("rhyme_run_ahead") and custom.get("rhyme_prompt_id") is None:
        raise ValueError("custom_params.rhyme_run_ahead needs custom_params.rhyme_prompt_id")


_RHYME_KEYS = ("rhyme_prompt_id", "rhyme_sample", "rhyme_run_ahead")


def _check_rhyme_value(key: str, value) -> None:
    """ValueError naming ``custom_params.<key>`` when ``value`` (not None) is malformed."""
    if value is None:
        return
    if key == "rhyme_prompt_id" and (not isinstance(value, str) or not value):
        raise ValueError(f"custom_params.rhyme_prompt_id must be a non-empty string, got {value!r}")
    if key == "rhyme_sample" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"custom_params.rhyme_sample must be an integer >= 0, got {value!r}")
    if key == "rhyme_run_ahead" and not isinstance(value, bool):
        raise ValueError(f"custom_params.rhyme_run_ahead must be a boolean, got {value!r}")


def custom_param(req, key: str):
    """A RHYME custom parameter of a scheduler request, None when absent or malformed
    (requests are validated before they reach the scheduler; this keeps a bad value from
    stopping it)."""
    params = getattr(req.sampling_params, "custom_params", None)
    value = params.get(key) if isinstance(params, dict) else None
    try:
        _check_rhyme_value(key, value)
    except ValueError:
        return None
    return value


def is_run_ahead(req) -> bool:
    """Whether scheduler request ``req`` is a run-ahead request (``custom_params
    ["rhyme_run_ahead"]`` true): draft-only tokens for a coming step."""
    return custom_param(req, "rhyme_run_ahead") is True


def check_token_ids(input_ids, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first token id outside ``[0, vocab_size)``."""
    if input_ids is None:
        return
    for pos, tok in enumerate(input_ids):
        if not isinstance(tok, int) or tok < 0 or tok >= vocab_size:
            raise ValueError(
                f"input token id {tok!r} at position {pos} is outside the vocabulary [0, {vocab_size})"
            )


def install_token_id_check() -> None:
    """Wrap ``TokenizerManager._validate_one_request`` with the vocabulary check (idempotent)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    original = TokenizerManager._validate_one_request
    if getattr(original, "__rhyme_wrapped__", False):
        return

    def _validate_one_request(self, obj, input_ids):
        check_token_ids(input_ids, self.model_config.vocab_size)
        check_rhyme_params(getattr(obj, "sampling_params", None))
        return original(self, obj, input_ids)

    _validate_one_request.__rhyme_wrapped__ = True
    TokenizerManager._validate_one_request = _validate_one_request
