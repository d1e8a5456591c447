"""``KVFENCE_<FLAG>`` environment variables as flag defaults, checked only when used.

A variable becomes the flag's default as an unconverted ``EnvDefault``; ``resolve_env`` turns
the chosen subcommand's into values after parsing (one line naming the variable when one is
bad), so a bad ``KVFENCE_PORT`` breaks ``kvfence serve`` and nothing else. The flag wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "KVFENCE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def env_name(flag: str) -> str:
    """``--kv-memory`` -> ``KVFENCE_KV_MEMORY``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True, slots=True)
class EnvDefault:
    """A ``KVFENCE_<FLAG>`` value as a flag's default, converted by ``resolve`` only once that
    flag's subcommand was chosen (argparse would convert a plain string default itself)."""

    name: str
    flag: str
    text: str
    kind: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    switch: bool = False

    def __str__(self) -> str:
        return self.text

    def resolve(self) -> Any:
        if self.switch:
            text = self.text.strip().lower()
            if text not in _TRUE | _FALSE:
                raise UsageError(f"{self.name}={self.text!r}: use 1/0, true/false, yes/no")
            return text in _TRUE
        try:
            value = self.kind(self.text) if self.kind is not None else self.text
        except (ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"{self.name}={self.text!r}: not a valid value for {self.flag}"
                             ) from None
        if self.choices is not None and value not in self.choices:
            raise UsageError(f"{self.name}={self.text!r}: use one of {', '.join(self.choices)}")
        return value


def add_flag(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """A flag whose default comes from ``KVFENCE_<FLAG>`` when that is set."""
    env = os.environ.get(env_name(flag))
    if env is not None:
        default = EnvDefault(env_name(flag), flag, env, kw.get("type"), kw.get("choices"))
    parser.add_argument(flag, default=default, help=f"{help} [env {env_name(flag)}]", **kw)


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = os.environ.get(env_name(flag))
    default = False if env is None else EnvDefault(env_name(flag), flag, env, switch=True)
    parser.add_argument(flag, action="store_true", default=default,
                        help=f"{help} [env {env_name(flag)}]")


class _Repeated(argparse.Action):
    """A repeatable flag whose given values replace its environment default (a tuple)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        given = list(current) if isinstance(current, list) else []
        setattr(namespace, self.dest, [*given, values])


def add_repeated_flag(parser: argparse.ArgumentParser, flag: str, help: str, metavar: str) -> None:
    """A flag that may be given several times; without it, ``KVFENCE_<FLAG>`` (values
    separated by commas) or none."""
    env = os.environ.get(env_name(flag))
    default = None if env is None else tuple(v.strip() for v in env.split(",") if v.strip())
    parser.add_argument(flag, action=_Repeated, default=default, metavar=metavar,
                        help=f"{help} [env {env_name(flag)}]")


def resolve_env(args: argparse.Namespace) -> argparse.Namespace:
    """Convert every ``EnvDefault`` left in ``args``; raises ``UsageError``."""
    for dest, value in vars(args).items():
        if isinstance(value, EnvDefault):
            setattr(args, dest, value.resolve())
    return args
