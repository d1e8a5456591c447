"""How every `kvfence` parser behaves: no abbreviated flags, defaults in `--help`, the
subcommand's own usage on an unknown flag, `--version`, and escapes in stop strings."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from importlib import metadata

_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


def version() -> str:
    try:
        return metadata.version("kvfence")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless it has none (None, False or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def new_parser(**kwargs: object) -> argparse.ArgumentParser:
    """The top-level parser: no abbreviated flags, `--version`, defaults shown in help."""
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     formatter_class=HelpFormatter,
                                     **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return parser


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                help: str, **kwargs: object) -> argparse.ArgumentParser:
    """A subcommand parser that knows itself, so `parse` reports errors with its usage."""
    p = subparsers.add_parser(name, help=help, description=help, allow_abbrev=False,
                              formatter_class=HelpFormatter,
                              **kwargs)  # type: ignore[arg-type]
    p.set_defaults(cli_parser=p)
    return p


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Like `parse_args`, but an unknown flag is reported with the subcommand's usage."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        owner: argparse.ArgumentParser = getattr(args, "cli_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def unescape(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\0` and `\\` as the characters they name (shells pass them literally)."""
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)
