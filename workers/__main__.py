"""``python -m workers COMMAND ...``: the worker host's command line.

Each command lives in its own module with ``add_arguments(parser)`` and
``main(args) -> int``; they are imported only when chosen, so ``loadgen`` on
a laptop does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # imported only when the command is chosen
    summary: str
    add_arguments: str = "add_arguments"  # the module's functions for this command
    main: str = "main"


COMMANDS: dict[str, Command] = {
    "make-tiny-model": Command(
        "workers.engines.reference.tiny", "put the project's tiny Llama checkpoint in a directory"
    ),
    "build-tiny-model": Command(
        "workers.engines.reference.tiny",
        "train the tiny checkpoint from its recipe and rewrite the shipped copy",
        add_arguments="add_build_arguments",
        main="main_build",
    ),
    "bench": Command("workers.bench.prefill", "benchmark prefill modes on a seeded long-tailed workload"),
    "serve": Command("workers.server.cli", "serve the OpenAI API from one engine, with the agent"),
    "loadgen": Command("workers.loadgen", "drive an OpenAI endpoint with streaming traffic"),
    "replay": Command("workers.replay", "replay a captured workload against one worker at its recorded rate"),
    "gpu-check": Command(
        "workers.bench.gpu_check", "check the reference engine on a GPU: parity, memory, stalls, roofline, overhead"
    ),
    "bench-sim": Command(
        "workers.bench.sim", "validate the simulated engine against AIConfigurator's estimates and the reference engine"
    ),
    "bench-serve": Command(
        "workers.bench.serve", "benchmark HTTP against in-process streaming, and vLLM against reference"
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m workers")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.summary, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command = COMMANDS[argv[0]]
    module = importlib.import_module(command.module)
    cmd_parser = argparse.ArgumentParser(prog=f"python -m workers {argv[0]}", description=command.summary)
    getattr(module, command.add_arguments)(cmd_parser)
    return int(getattr(module, command.main)(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
