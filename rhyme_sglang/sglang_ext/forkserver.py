"""An engine's scheduler and detokenizer forked from a process that has sglang imported already.

SGLang spawns each engine's scheduler and detokenizer as fresh interpreters, and each spends
~14 s of CPU importing sglang (its import graph: torch, transformers, fastapi, ...) before it
does any work. With ``RHYME_START_METHOD=forkserver`` (the default on a CPU-only machine) they
are forked instead from multiprocessing's fork server, which imports sglang once per launching
process (:mod:`rhyme_sglang.sglang_ext.forkserver_preload`). :func:`warm_up` starts it when
``rhyme_sglang.Engine`` is first imported (and at the top of ``launch_server``), so that import
runs beside the process's own import of sglang; every later engine of that process (a test
module's engines, a restarted engine) starts without one.

What a forked child would otherwise get wrong, and how it is kept as with ``spawn``:

- **Environment and working directory.** A fork-server child inherits the fork server's,
  taken when the server started; each child is handed its launcher's ``os.environ`` and cwd at
  launch (RHYME's engine settings travel in the environment).
- **Parent.** sglang's children signal ``psutil.Process().parent()`` (SIGQUIT) when they fail;
  in a forked child that answer is the launching process, not the fork server.
- **Shutdown.** The children are the fork server's, not the launcher's: :func:`started` lists
  the processes an engine launched, so its shutdown stops exactly those
  (:mod:`rhyme_sglang.sglang_ext.own_children`), and the fork server lives on for the next.

The reach into sglang is one module-level name, ``sglang.srt.entrypoints.engine.mp``.
``RHYME_START_METHOD=spawn`` restores sglang's own behaviour; GPU machines keep ``spawn``.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import ForkServerProcess
from typing import List

from rhyme_sglang import settings

START_METHOD_ENV = settings.ENV_NAMES["start_method"]
PRELOAD = "rhyme_sglang.sglang_ext.forkserver_preload"
_launched: List[int] = []  # PIDs of the processes started through _Multiprocessing


def start_method() -> str:
    """``forkserver`` or ``spawn``: the env var when set, else forkserver on a CPU-only machine."""
    value = settings.settings().start_method
    if value != "auto":
        return value
    from rhyme_sglang.sglang_ext.cpu_defaults import on_cpu_only_machine

    return "forkserver" if on_cpu_only_machine() else "spawn"


class _AsLaunched:
    """A child's target, run with its launcher's environment, cwd and parent."""

    def __init__(self, target, env: dict, cwd: str, launcher: int):
        self.target, self.env, self.cwd, self.launcher = target, env, cwd, launcher

    def __call__(self, *args, **kwargs):
        try:  # set up the title area first: once the environment is replaced, setproctitle
            import setproctitle  # cannot, and ps would not show sglang's "sglang::scheduler"

            setproctitle.getproctitle()
        except ImportError:
            pass
        os.environ.clear()
        os.environ.update(self.env)
        settings.reload()  # the fork server's copy was read from its own environment
        os.chdir(self.cwd)
        _report_parent_as(self.launcher)
        return self.target(*args, **kwargs)


def _report_parent_as(launcher: int) -> None:
    """Make ``psutil.Process().parent()`` in this process name ``launcher``."""
    import psutil

    me, original = os.getpid(), psutil.Process.parent

    def parent(self):
        return psutil.Process(launcher) if self.pid == me else original(self)

    psutil.Process.parent = parent


class _Multiprocessing:
    """Stands in for the ``multiprocessing`` module inside sglang's engine module: the same
    module, except that ``Process`` is forked from the fork server and recorded."""

    def __getattr__(self, name):
        return getattr(multiprocessing, name)

    @staticmethod
    def Process(group=None, target=None, name=None, args=(), kwargs=None, *, daemon=None):
        return _RecordedProcess(group=group, name=name, args=args, kwargs=kwargs or {},
                                daemon=daemon, target=_AsLaunched(target, dict(os.environ),
                                                                  os.getcwd(), os.getpid()))


class _RecordedProcess(ForkServerProcess):
    """A fork-server process that records its PID when it starts (only the PID is kept)."""

    def start(self) -> None:
        super().start()
        _launched.append(self.pid)


def warm_up() -> None:
    """Start the fork server now, where it will be used: it imports sglang in the background,
    beside this process's own import of it, instead of after it at the first engine's launch."""
    if start_method() == "forkserver":
        _start_server()


def _start_server() -> None:
    """Start the fork server with sglang preloaded (a no-op when it runs already)."""
    from multiprocessing import forkserver as mp_forkserver

    multiprocessing.set_forkserver_preload([PRELOAD])
    mp_forkserver.ensure_running()


def install() -> str:
    """Route sglang's engine launches through the fork server (when chosen); -> the method."""
    method = start_method()
    from sglang.srt.entrypoints import engine as sglang_engine

    if method == "forkserver":
        _start_server()
        if not isinstance(sglang_engine.mp, _Multiprocessing):
            sglang_engine.mp = _Multiprocessing()
    elif isinstance(sglang_engine.mp, _Multiprocessing):
        sglang_engine.mp = multiprocessing
    return method


def mark() -> int:
    """A position in the launch record, for :func:`started`."""
    return len(_launched)


def started(since: int) -> set:
    """PIDs of the processes launched through the fork server since ``mark()`` gave ``since``."""
    return set(_launched[since:])


def server_pid():
    """The fork server's PID, or None when none runs."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
