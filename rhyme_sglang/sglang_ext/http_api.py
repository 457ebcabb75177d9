"""HTTP additions to SGLang's FastAPI app: request validation (4xx, never a crash)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_INSTALLED = False


def install() -> None:
    """Add our middleware and routes to ``sglang.srt.entrypoints.http_server.app`` once."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.entrypoints import http_server

    from rhyme_sglang.sglang_ext.validation import (
        RequestValidationMiddleware,
        install_token_id_check,
    )

    install_token_id_check()
    http_server.app.add_middleware(RequestValidationMiddleware)
    _INSTALLED = True
