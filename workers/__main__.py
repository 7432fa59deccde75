"""``python -m workers COMMAND ...``: the worker host's command line.

Each command lives in its own module with ``add_arguments(parser)`` and
``main(args) -> int``; they are imported only when chosen, so ``loadgen`` on
a laptop does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("workers.engine.tiny", "write the project's tiny Llama checkpoint"),
    "bench": ("workers.bench", "benchmark prefill modes on a seeded long-tailed workload"),
    "serve": ("workers.server.cli", "serve the OpenAI API from one engine, with the agent"),
    "loadgen": ("workers.loadgen", "drive an OpenAI endpoint with streaming traffic"),
    "bench-serve": ("workers.bench_serve", "benchmark HTTP against in-process streaming, and vLLM against reference"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m workers")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"python -m workers {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    return int(module.main(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
