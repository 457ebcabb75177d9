"""Entry point of sglang's scheduler process (spawned), with rhyme-sglang's setup first."""

from __future__ import annotations


def run_scheduler_process(*args, **kwargs):
    """Activate the CPU backend, set the compute threads and keep freed memory mapped
    (:mod:`rhyme_sglang.cpu_backend.malloc`) in this fresh process, then run sglang's
    scheduler."""
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults, on_cpu_only_machine

    thread_lock_for_tqdm()
    apply_cpu_defaults({})
    if on_cpu_only_machine():
        from rhyme_sglang.cpu_backend.malloc import keep_freed_memory
        from rhyme_sglang.machine import set_scheduler_threads

        set_scheduler_threads()
        keep_freed_memory()
    from sglang.srt.managers.scheduler import run_scheduler_process as _run

    from rhyme_sglang.sglang_ext.timeline import maybe_serve

    maybe_serve(args[0] if args else kwargs.get("server_args"))
    return _run(*args, **kwargs)


def thread_lock_for_tqdm() -> None:
    """Make tqdm's bars in this process (sglang's weight loading) lock with a thread lock.

    tqdm's default lock adds a multiprocessing lock, a named semaphore under any start method
    but fork; the engine's shutdown kills this process, so the name would outlive it and
    ``resource_tracker`` would report it leaked. No other process shares these bars."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
