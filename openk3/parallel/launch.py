"""`openk3 train --nproc N`: re-run the same command under torchrun with N processes on this machine.

    openk3 train --nproc 2 --batch-size 32 ...
 == torchrun --standalone --nproc-per-node 2 -m openk3.cli train --batch-size 32 ...

`--standalone` gives the run its own rendezvous on a free port, so two runs on one machine do not collide. For
several nodes, call torchrun yourself (README: "Training on several GPUs").
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def argv_from_namespace(parser: argparse.ArgumentParser, ns: argparse.Namespace, skip: set[str]) -> list[str]:
    """The command-line flags that reproduce the parsed values of `ns` (values equal to the parser's default are
    left out), for every option of `parser` whose dest is not in `skip`."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or action.dest == "help":
            continue
        value = getattr(ns, action.dest, None)
        if value is None or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def torchrun_command(nproc: int, command: str, argv: list[str]) -> list[str]:
    if nproc < 1:
        raise ValueError(f"--nproc={nproc}: must be a positive integer")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "openk3.cli", command, *argv]


def run_torchrun(nproc: int, command: str, argv: list[str]) -> None:
    """Run `openk3 COMMAND ARGV` under torchrun with `nproc` local processes; exit with its status if it fails."""
    rc = subprocess.run(torchrun_command(nproc, command, argv)).returncode
    if rc:
        raise SystemExit(rc)
