"""``python -m rhyme_sglang.launch_server``: SGLang's HTTP server with rhyme-sglang applied.

Accepts every ``sglang.launch_server`` flag. On a CPU-only machine it adds the CPU settings
the user did not give (device, intel_amx attention, memory, threads); it always binds to
127.0.0.1 unless ``--host`` is given, resolves the model aliases ``smollm2``/``tiny``, and
installs the request validation and ``/rhyme/*`` routes before serving. ``--dtype`` absent or
``auto`` is decided by measurement (:mod:`rhyme_sglang.machine`); ``--cpu-threads N`` (ours)
sets the scheduler's compute threads. Snapshot paths
(``--rhyme-snapshot-path``, ``/rhyme/save``, ``/rhyme/load``) resolve inside
``--rhyme-snapshot-dir``; without an admin key, a non-loopback ``--host`` gets a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

logger = logging.getLogger(__name__)

_CPU_FLAGS = (
    ("--device", "cpu"),
    ("--attention-backend", "intel_amx"),
    ("--sampling-backend", "pytorch"),
    ("--mem-fraction-static", "0.5"),
)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: list[str], flag: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def _pop_flag(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) and ``argv`` without it."""
    value, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(flag + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def pop_cpu_threads(argv: list[str], flag: str = "--cpu-threads") -> tuple[int | None, list[str]]:
    """``--cpu-threads N`` (ours): the scheduler's torch compute threads (``--kernel-threads
    N``: its native kernels' threads); None when absent/auto."""
    value, argv = _pop_flag(argv, flag)
    if value in (None, "auto", "0"):
        return None, argv
    if not value.isdigit():
        raise ValueError(f"{flag} must be a positive int or 'auto', got {value!r}")
    return int(value), argv


def prepare_argv(argv: list[str], cpu_only: bool, dtype_resolver=None) -> list[str]:
    """Resolve the model alias and ``--dtype auto`` (also when absent: the measured choice of
    ``dtype_resolver``, default :func:`rhyme_sglang.dtypes.resolve_dtype`), and add defaults
    for flags the user did not pass."""
    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.models import resolve_model_path

    dtype, argv = _pop_flag(list(argv), "--dtype")
    argv += ["--dtype", (dtype_resolver or resolve_dtype)(dtype or "auto")]

    for i, arg in enumerate(argv):
        if arg in ("--model-path", "--model") and i + 1 < len(argv):
            argv[i + 1] = resolve_model_path(argv[i + 1])
        elif arg.startswith("--model-path="):
            argv[i] = "--model-path=" + resolve_model_path(arg.split("=", 1)[1])
    if not _has_flag(argv, "--host"):
        argv += ["--host", "127.0.0.1"]
    if cpu_only:
        if not _has_flag(argv, "--max-total-tokens"):  # sized per model and dtype
            from rhyme_sglang.sglang_ext.cpu_defaults import kv_pool_tokens

            model = _flag_value(argv, "--model-path", _flag_value(argv, "--model", ""))
            dtype = _flag_value(argv, "--dtype", "float32")
            argv += ["--max-total-tokens", str(kv_pool_tokens(model, dtype))]
        for flag, value in _CPU_FLAGS:
            if not _has_flag(argv, flag):
                argv += [flag, value]
        for flag in ("--disable-cuda-graph", "--sleep-on-idle"):  # see cpu_defaults.CPU_DEFAULTS
            if not _has_flag(argv, flag):
                argv.append(flag)
    return argv


def exposure_warning(host: str, keyless: bool) -> str | None:
    """The start-up warning for a server reachable beyond loopback without an admin key."""
    from rhyme_sglang.sglang_ext.http_api import is_loopback

    if not keyless or is_loopback(host):
        return None
    return (f"rhyme: serving on --host {host} with no --admin-api-key: the /rhyme/* admin "
            "routes (save, load, reset, rewards, advance_epoch, history, draft, "
            "schedule_policy) answer loopback clients only, and SGLang's own weight and cache "
            "endpoints stay open to every client that reaches this port; set --admin-api-key")


_DESCRIPTION = ("SGLang's HTTP server with rhyme-sglang applied: every sglang.launch_server flag, "
                "plus RHYME's. On a CPU-only machine the CPU settings not given are filled in; "
                "it binds to 127.0.0.1 unless --host is given.")


def help_parser() -> argparse.ArgumentParser:
    """The ``--help`` parser: RHYME's flags and ours first, then SGLang's (only for the text:
    :func:`main` parses a command line without it)."""
    from sglang.srt.server_args import ServerArgs

    from rhyme_sglang.sglang_ext.flags import add_help_group

    parser = argparse.ArgumentParser(
        prog="python -m rhyme_sglang.launch_server", description=_DESCRIPTION,
        usage="%(prog)s --model-path PATH [--speculative-algorithm RHYME] [--rhyme-* VALUE ...] "
        "[SGLang server flags]",
        epilog="Example: python -m rhyme_sglang.launch_server --model-path smollm2 "
        "--speculative-algorithm RHYME --speculative-num-draft-tokens 17")
    add_help_group(parser)
    ours = parser.add_argument_group("rhyme-sglang on CPU")
    ours.add_argument("--cpu-threads", metavar="N", help="the scheduler's torch compute threads "
                      "(default: auto, the machine's measured rule)")
    ours.add_argument("--kernel-threads", metavar="N", help="the scheduler's native kernel "
                      "threads (default: auto)")
    ServerArgs.add_cli_args(parser.add_argument_group("SGLang server"))
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        help_parser().print_help()
        return
    from rhyme_sglang.sglang_ext import check_sglang_version
    from rhyme_sglang.sglang_ext.config import RhymeConfig, new_control_addr
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults, on_cpu_only_machine

    check_sglang_version()
    cpu_only = on_cpu_only_machine()
    threads, argv = pop_cpu_threads(argv)
    kernels, argv = pop_cpu_threads(argv, "--kernel-threads")
    apply_cpu_defaults({"cpu_threads": threads, "kernel_threads": kernels})
    from rhyme_sglang.sglang_ext import forkserver

    forkserver.warm_up()  # it imports sglang beside this process
    rhyme_config, argv = RhymeConfig.pop_from_argv(argv)
    argv = prepare_argv(argv, cpu_only)
    snapshot_root = rhyme_config.snapshot_root()
    if rhyme_config.snapshot_path:
        from rhyme_sglang.sglang_ext.snapshot_paths import confine

        path = confine(rhyme_config.snapshot_path, snapshot_root)  # ValueError: refuse to start
        rhyme_config = dataclasses.replace(rhyme_config, snapshot_path=path)
    # every server gets a control channel: RHYME's scheduler serves all /rhyme/* commands on
    # it, any other mode's scheduler only the time breakdown (timeline.maybe_serve)
    rhyme = _flag_value(argv, "--speculative-algorithm", "").upper() == "RHYME"
    control_addr = new_control_addr()
    dataclasses.replace(rhyme_config, control_addr=control_addr).to_env()

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from rhyme_sglang.sglang_ext import http_api
    from rhyme_sglang.sglang_ext.process import run_scheduler_process

    load_plugins()
    server_args = prepare_server_args(argv)
    keyless = not (server_args.admin_api_key or server_args.api_key)
    warning = exposure_warning(server_args.host, keyless)
    if warning:
        logger.warning(warning)
    http_api.install(control_addr, snapshot_root=snapshot_root, keyless_admin=keyless,
                     rhyme=rhyme)
    from sglang.srt.entrypoints.http_server import launch_server

    forkserver.install()
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
