"""`diffusers-offload`: plan model offload before downloading any weights, run the demo, check the environment.

    diffusers-offload plan --model flux-dev --vram 24GiB --steps 28 --generations 10 [--preview]
    diffusers-offload demo [--png timeline.png]
    diffusers-offload doctor

Every command takes `--json` (exactly one JSON document on stdout, errors included). Exit codes: 0 success, 2 a usage
error (bad argument, unknown model, unreadable file, unwritable output path), 1 anything else (such as a missing
optional package). Importing this package loads neither torch nor diffusers; each command loads what it needs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Optional, Sequence

from . import demo, doctor, output, plan

USAGE = 2
OTHER = 1
INTERRUPTED = 130
TRACEBACK_ENV = "DIFFUSERS_OFFLOAD_TRACEBACK"


class UsageError(Exception):
    """An argparse error (unknown option, missing value)."""


class Parser(argparse.ArgumentParser):
    """argparse, with errors raised (so that `--json` can report them as JSON), the nearest option or command
    suggested for a mistyped one, and help as JSON under `--json`."""

    json_mode = False
    #: Every option and command of the tool, for suggestions (set by `build_parser`).
    known: Sequence[str] = ()

    def error(self, message: str):
        raise UsageError(f"{message}{suggestion(message, self.known)} (see {self.prog} --help)")

    def print_help(self, file=None) -> None:
        if self.json_mode:
            output.emit_json({"help": self.format_help()})
        else:
            super().print_help(file)


def suggestion(message: str, known: Sequence[str]) -> str:
    """`"; did you mean --vram?"` for argparse's message about an unknown option or command, else `""`."""
    if "unrecognized arguments:" in message:
        words = [w.split("=", 1)[0] for w in message.split("unrecognized arguments:", 1)[1].split() if w[:1] == "-"]
    elif "invalid choice:" in message:
        words = message.split("invalid choice:", 1)[1].split("'")[1:2]
    else:
        return ""
    options = [k for k in known if k.startswith("-")] if words and words[0].startswith("-") else known
    near = [difflib.get_close_matches(w, options, n=1, cutoff=0.6) for w in words]
    hints = [(w, n[0]) for w, n in zip(words, near) if n]
    if not hints:
        return ""
    if len(words) == 1:
        return f"; did you mean {hints[0][1]}?"
    return "; did you mean " + ", ".join(f"{n} for {w}" for w, n in hints) + "?"


def build_parser(json_mode: bool = False) -> Parser:
    parser = Parser(prog=output.PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    # `--json` is accepted after the command too; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    commands = parser.add_subparsers(dest="command", metavar="{plan,demo,doctor}", parser_class=Parser)
    commands.required = True
    for module in (plan, demo, doctor):
        module.add_parser(commands, common)
    known = sorted({o for sub in [parser, *commands.choices.values()] for o in sub._option_string_actions})
    for sub in [parser, *commands.choices.values()]:
        sub.json_mode = json_mode
        sub.known = known + sorted(commands.choices)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `diffusers-offload`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = build_parser(as_json).parse_args(argv)
    except UsageError as error:
        return output.error(str(error), USAGE, as_json, kind="usage error")
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    try:
        return args.handler(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OTHER
    except KeyboardInterrupt:
        return output.error("interrupted", INTERRUPTED, as_json)
    except Exception as error:
        return _failure(error, as_json)


def _failure(error: Exception, as_json: bool) -> int:
    from ..models.errors import MissingPackage, PlanError

    if isinstance(error, PlanError):
        return output.error(str(error), USAGE, as_json, error.argument)
    if isinstance(error, output.OutputPathError):
        return output.error(str(error), USAGE, as_json)
    if isinstance(error, MissingPackage):
        return output.error(str(error), OTHER, as_json)
    if os.environ.get(TRACEBACK_ENV):
        raise error
    message = f"{type(error).__name__}: {error} (set {TRACEBACK_ENV}=1 to see the traceback)"
    return output.error(message, OTHER, as_json, kind="internal error")
