"""``python -m rhyme_sglang.cpu_backend {install,uninstall,status}``."""

from __future__ import annotations

import argparse
import sys

from rhyme_sglang import cpu_backend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rhyme_sglang.cpu_backend")
    parser.add_argument("command", choices=["install", "uninstall", "status"])
    args = parser.parse_args(argv)
    if args.command == "install":
        print(f"installed {cpu_backend.install_hook()}")
    elif args.command == "uninstall":
        print("removed" if cpu_backend.uninstall_hook() else "not installed")
    else:
        from rhyme_sglang.cpu_backend import bootstrap

        print(f"hook file: {cpu_backend.pth_path()} exists={cpu_backend.pth_path().exists()}")
        print(f"stand-in active: {bootstrap.standin_active()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
