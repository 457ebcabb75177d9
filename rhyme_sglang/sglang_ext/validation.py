"""Request validation in front of SGLang: malformed input gets a clear 4xx, never a crash.

Two layers:
* :class:`RequestValidationMiddleware` (HTTP): ``/generate`` bodies must be JSON objects
  with known fields and known sampling-parameter names.
* :func:`install_token_id_check` (tokenizer manager, so HTTP and ``Engine`` alike): every
  input token id must be an int in ``[0, vocab_size)``; sglang 0.5.23 otherwise lets an
  out-of-vocabulary id reach the model and the scheduler process dies. RHYME's
  ``custom_params`` (``rhyme_prompt_id``: non-empty str, ``rhyme_sample``: int >= 0) are
  checked in both layers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)
_VALIDATED_PATHS = ("/generate",)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


@functools.lru_cache(maxsize=1)
def _allowed_fields() -> tuple[frozenset, frozenset]:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    top = frozenset(f.name for f in dataclasses.fields(GenerateReqInput))
    sampling = frozenset(inspect.signature(SamplingParams).parameters)  # a msgspec Struct
    return top, sampling


def check_generate_body(body) -> str | None:
    """Return an error message for a malformed ``/generate`` body, or None if it is fine."""
    if not isinstance(body, dict):
        return f"request body must be a JSON object, got {type(body).__name__}"
    top, sampling = _allowed_fields()
    unknown = sorted(set(body) - top)
    if unknown:
        return f"unknown field(s) {unknown} in /generate request"
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        if p is None:
            continue
        if not isinstance(p, dict):
            return f"sampling_params must be an object, got {type(p).__name__}"
        bad = sorted(set(p) - sampling)
        if bad:
            return f"unknown sampling parameter(s) {bad}"
        mnt = p.get("max_new_tokens")
        if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 0):
            return f"max_new_tokens must be a non-negative integer, got {mnt!r}"
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
            v = p.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"{name} must be a number, got {v!r}"
        try:
            check_rhyme_params(p)
        except ValueError as exc:
            return str(exc)
    ids = body.get("input_ids")
    if ids is not None:
        rows = ids if ids and isinstance(ids[0], list) else [ids] if isinstance(ids, list) else None
        if rows is None:
            return f"input_ids must be a list of ints (or a list of lists), got {type(ids).__name__}"
        for row in rows:
            if not isinstance(row, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in row
            ):
                return "input_ids must contain only integers"
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
    pid = custom.get("rhyme_prompt_id")
    if pid is not None and (not isinstance(pid, str) or not pid):
        raise ValueError(f"custom_params.rhyme_prompt_id must be a non-empty string, got {pid!r}")
    sample = custom.get("rhyme_sample")
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 0):
        raise ValueError(f"custom_params.rhyme_sample must be an integer >= 0, got {sample!r}")


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
