"""The ``jaxpar`` command: one subcommand per module.

    jaxpar shardings --model llama3-70b --mesh fsdp_tp --devices 64

A subcommand is a module listed in ``COMMANDS`` that defines

    HELP: str                                   one line for ``jaxpar --help``
    add_arguments(parser) -> None               its options
    run(args) -> int                            the exit status

Adding ``train``, ``plan`` or ``convert`` is one line here plus that module. Modules are imported to
build the parser, so they must not touch a jax backend at import time (``--devices`` simulates CPU
devices, which only works before the first JAX operation); import flax and the zoo inside ``run``.

Errors the user can fix (``jaxpar.errors``: unknown preset, indivisible sizes, a run directory of another
model, ...) print one line, ``jaxpar: error: <message>``, to stderr and exit with status 2, like the
parser's own usage errors (``jaxpar train: error: argument --steps: ...``). A run that fails on the way
(``NonFiniteError``: a NaN loss) prints the same way and exits with 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from jaxpar.errors import JaxparError, NonFiniteError

COMMANDS: dict[str, str] = {
    "shardings": "jaxpar.shardings",
    "train": "jaxpar.train.command",
    "prepare": "jaxpar.prepare",
    "convert": "jaxpar.convert.command",
    "plan": "jaxpar.analysis.plan_command",
    "pipeline": "jaxpar.pipeline.command",
    "generate": "jaxpar.inference.command",
    "serve": "jaxpar.inference.serve_command",
    "grpo": "jaxpar.rl.command",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line on stderr, as jaxpar's own are (status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` shows the usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxpar", description="A JAX model zoo for parallelism.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script and ``python -m jaxpar``; returns the exit status."""
    parser = build_parser()
    for arg in sys.argv[1:] if argv is None else argv:
        if "\x00" in arg:  # no path or value holds one (a shell cannot pass it; main() can be called)
            parser.error(f"{arg!r}: a NUL character")
    args = parser.parse_args(argv)
    try:
        return args._run(args)
    except JaxparError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 1 if isinstance(err, NonFiniteError) else 2
    except BrokenPipeError:  # output piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
