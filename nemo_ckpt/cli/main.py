"""The ``nemo-ckpt`` parser and entry point; each command lives in its own module."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from nemo_ckpt.cli import diff, gc, inspect, ls, rm, status, verify
from nemo_ckpt.cli.render import PROG

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nemo-ckpt``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, list and remove nemo-ckpt environment "
                    "snapshots, and see the session holders of a running job.")
    try:
        parser.add_argument("--version", action="version",
                            version=f"%(prog)s {metadata.version(PROG)}")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        pass
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    path_help = "the checkpoint path handed to snapshot(): the folder holding environment/"
    inspect.add_parser(sub, path_help)
    verify.add_parser(sub, path_help)
    diff.add_parser(sub)
    status.add_parser(sub)
    gc.add_parser(sub)
    ls.add_parser(sub)
    rm.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nemo-ckpt`` with ``argv`` (default: the process's arguments); return the
    exit code."""
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        code: int = args.run(args, out, err)
        out.flush()
        return code
    except BrokenPipeError:
        # `nemo-ckpt inspect PATH | head`: the reader left; exit quietly.
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except KeyboardInterrupt:
        return 130
