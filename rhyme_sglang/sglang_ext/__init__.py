"""The SGLang integration: the only package that imports sglang internals.

Every module here targets sglang ``SUPPORTED_SGLANG_VERSION``; :func:`check_sglang_version`
fails loudly on any other version instead of misbehaving.
"""

SUPPORTED_SGLANG_VERSION = "0.5.23"
ALGORITHM = "RHYME"  # the speculative algorithm's name in sglang's registry


def check_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError as exc:
        raise ImportError("rhyme-sglang needs sglang; run `make setup`") from exc
    if found != SUPPORTED_SGLANG_VERSION:
        raise ImportError(
            f"rhyme-sglang targets sglang=={SUPPORTED_SGLANG_VERSION}, found sglang=={found}"
        )
    return found
