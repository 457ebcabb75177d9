"""Engine children forked from the fork server run as if spawned by their launcher: its
environment and working directory at launch, the launcher as their parent, and a process title
of their own (as sglang's children set)."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from rhyme_sglang.sglang_ext import forkserver


def _report(conn):
    import psutil
    import setproctitle

    setproctitle.setproctitle("rhyme::probe")  # as sglang names its children
    title = open(f"/proc/{os.getpid()}/cmdline").read().split("\0")[0].strip()
    conn.send((os.environ.get("RHYME_PROBE"), os.getcwd(), psutil.Process().parent().pid, title))
    conn.close()


def test_forked_child_gets_its_launchers_environment_cwd_and_parent(tmp_path, monkeypatch):
    from multiprocessing import forkserver as mp_forkserver

    mp_forkserver.ensure_running()  # started before the change below, as for a later engine
    monkeypatch.setenv("RHYME_PROBE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    reader, writer = multiprocessing.Pipe(duplex=False)
    since = forkserver.mark()
    proc = forkserver._Multiprocessing().Process(target=_report, args=(writer,))
    proc.start()
    writer.close()
    try:
        assert reader.poll(60), "the forked child did not report"
        probe, cwd, parent, title = reader.recv()
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert (probe, cwd, parent) == ("set-after-the-server-started", str(tmp_path), os.getpid())
    assert title == "rhyme::probe"
    assert forkserver.started(since) == {proc.pid}
    assert forkserver._launched[since:] == [proc.pid]  # only the PID is kept
    assert forkserver.server_pid() not in (None, proc.pid)


def test_start_method_is_chosen_by_env_or_machine(monkeypatch):
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "spawn")
    assert forkserver.start_method() == "spawn"
    monkeypatch.setenv(forkserver.START_METHOD_ENV, " ForkServer ")
    assert forkserver.start_method() == "forkserver"
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=forkserver.START_METHOD_ENV):
        forkserver.start_method()
    monkeypatch.delenv(forkserver.START_METHOD_ENV)
    import torch

    assert forkserver.start_method() == ("spawn" if torch.cuda.is_available() else "forkserver")
