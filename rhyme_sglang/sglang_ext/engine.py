"""``rhyme_sglang.Engine``: how a process gets the offline engine class.

Importing this module does nothing. Asking it for ``Engine`` prepares the process once
(:func:`prepare_process`), then imports the class from
:mod:`rhyme_sglang.sglang_ext.offline_engine`.
"""

from __future__ import annotations

_prepared = False


def prepare_process() -> None:
    """Once per process, before sglang is imported: check sglang's version, set the CPU
    environment and the CPU backend's finders, start the fork server (it imports sglang beside
    this process; not in a child that multiprocessing is still bootstrapping, which re-imports
    its parent's main module and may not start processes), then check token ids at the
    tokenizer manager."""
    global _prepared
    if _prepared:
        return
    import multiprocessing

    from rhyme_sglang.sglang_ext import check_sglang_version, forkserver
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults

    check_sglang_version()
    apply_cpu_defaults({})
    if not getattr(multiprocessing.current_process(), "_inheriting", False):  # what it checks
        forkserver.warm_up()
    from rhyme_sglang.sglang_ext.validation import install_token_id_check

    install_token_id_check()
    _prepared = True


def __getattr__(name: str):
    if name == "Engine":
        prepare_process()
        from rhyme_sglang.sglang_ext.offline_engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
