"""Helpers shared by the CLI commands: running coroutines, error reporting, bus access.

No traceback reaches a user: every error is one line on stderr (``error: …``) and a non-zero
exit — 2 for a bad argument or request (``invalid_request``, a usage error), 1 otherwise.
``OneLineErrors`` (the ``belayer`` app's command class) does it for usage errors and for
anything a command did not catch; ``run`` for what a coroutine raises."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import msgspec
import typer
from typer.core import TyperGroup

from common.bus import connect
from common.codec import decode, encode
from common.config import RunPaths
from common.errors import BelayerError, InvalidRequest
from common.node import resolve_bus

if TYPE_CHECKING:
    from rich.console import Console

# asyncio warns on every TLS connection a command closes ("returning true from
# eof_received() has no effect when using ssl"): noise on a command's stderr, which keeps
# one line per error.
logging.getLogger("asyncio").setLevel(logging.ERROR)

T = TypeVar("T")
M = TypeVar("M")


HELP_MARKUP = None
"""``--help`` as click lays it out (``typer.Typer(rich_markup_mode=...)``): options and their
text wrapped to the terminal (at most 80 columns), nothing cut. Typer's Rich panels cut every
word longer than their narrow columns with an ellipsis — at 80 columns `belayer up --help` lost
14 (``--creds-dir,--cr…``, ``--heartbeat-inte…``, URLs and examples)."""


def _whole_hyphenated_words() -> None:
    """Help text is wrapped by ``textwrap`` (in the copy of click that typer ships), which
    breaks a line after any hyphen: examples and flags came out cut (``worker-`` /
    ``kill@step=1``, ``--no-`` / ``shadows``) and could not be copied. The wrapper it looks up
    for each help text breaks at spaces only from here on (left as it is if typer's layout
    changes: the help test then sees the cut words)."""
    import importlib

    for name in ("typer._click._textwrap", "click._textwrap"):  # typer's copy, else click
        try:
            wrapping = importlib.import_module(name)
        except ImportError:
            continue
        base = getattr(wrapping, "TextWrapper", None)
        if isinstance(base, type):
            _break_at_spaces(wrapping, base)
            return


def _break_at_spaces(wrapping: Any, base: type) -> None:
    """Replace ``wrapping.TextWrapper`` by a ``base`` that keeps hyphenated words whole."""

    class WholeWords(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("break_on_hyphens", False)
            super().__init__(*args, **kwargs)

    setattr(wrapping, "TextWrapper", WholeWords)  # noqa: B010  # a module attribute


_whole_hyphenated_words()


def one_line(message: str) -> str:
    """``message`` on one line (newlines and runs of spaces folded)."""
    return " ".join(message.split())


TERMINATED_EXIT = 143
"""Exit status of a command stopped by SIGTERM (128 + 15, as the shell reports it)."""

_TERMINATED: list[bool] = []


def terminate_as_interrupt() -> None:
    """From now on SIGTERM is handled as Ctrl-C is (the default would end the process at once,
    leaving what it started running): it raises SIGINT, so ``KeyboardInterrupt`` — or, inside
    ``asyncio.run``, the main task's cancellation — lets every ``finally`` clause run (a run
    stops the node it started and writes its report); :func:`exit_status` then tells the two
    apart."""

    def handler(signum: int, frame: object) -> None:
        _TERMINATED.append(True)
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
            raise KeyboardInterrupt  # started in the background of a shell: SIGINT is ignored
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, handler)


def exit_status() -> int:
    """The exit status of an interrupted command: ``TERMINATED_EXIT`` after SIGTERM, else 130
    (Ctrl-C)."""
    return TERMINATED_EXIT if _TERMINATED else 130


def progress_console() -> Console:
    """The console a command's progress lines go to: stderr, wrapped to the terminal's width
    on a terminal, and one line per message on a pipe or a file (Rich would otherwise break
    them at 80 columns, mid-phrase, and a ``grep`` of a log would find half a line)."""
    from rich.console import Console

    return Console(file=sys.stderr, soft_wrap=not sys.stderr.isatty())


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; Belayer errors become one clear line and a non-zero exit (2 for an
    invalid request), and so does a value no message can carry (an integer past 64 bits)."""
    try:
        return asyncio.run(coro)
    except BelayerError as exc:
        fail(one_line(str(exc)), 2 if isinstance(exc, InvalidRequest) else 1)
    except (OverflowError, msgspec.EncodeError) as exc:
        fail(one_line(f"invalid request: {exc}"), 2)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def checked(msg: M) -> M:
    """``msg`` as a service would decode it; if a service would refuse it, the same
    ``invalid_request`` (naming the field) is the command's one error line, exit 2, before
    anything is sent — also for a value that does not even encode (an integer past 64 bits)."""
    try:
        return decode(encode(msg), type(msg))
    except InvalidRequest as exc:
        fail(one_line(str(exc)), 2)
    except (OverflowError, msgspec.EncodeError) as exc:
        fail(one_line(f"invalid request: {exc}"), 2)


def check_model(model: Path | None, chat: bool = True) -> None:
    """A ``--model`` that is not a checkpoint Belayer serves (with a ChatML tokenizer unless
    ``chat`` is false): one error line, exit 2, before anything starts."""
    if model is None:
        return
    from services.rl.options import check_model_dir

    try:
        check_model_dir(model.resolve(), chat=chat)
    except InvalidRequest as exc:
        fail(str(exc), 2)


def finite(value: float | None) -> float | None:
    """A typer callback: refuse NaN and infinities (click's ranges let NaN through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


class OneLineErrors(TyperGroup):
    """The ``belayer`` app's command class: a usage error (bad option, value out of range) is
    one ``error:`` line, exit 2 (click would print a usage block and a framed message), and an
    exception no command caught is one line, exit 1, instead of a traceback."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        reflow_help(self)

        def inner() -> Any:
            return super(OneLineErrors, self).main(
                args, prog_name, complete_var, False, windows_expand_args, **extra
            )

        if not standalone_mode:
            return inner()
        try:
            code = inner()
        except Exception as exc:
            sys.exit(_report(exc))
        sys.exit(code if isinstance(code, int) else 0)


_ITEM = re.compile(r"\s*([-*\u2022]|\d+[.)])\s")


def reflow(text: str) -> str:
    """A command's docstring as its ``--help`` should show it: the source's line breaks
    inside a paragraph joined (the terminal wraps), paragraphs, list items (``- ``, ``1. ``)
    and click's ``\\b`` (keep as is) paragraphs kept; anything after ``\\f`` unchanged."""
    head, cut, tail = inspect.cleandoc(text).partition("\f")
    out = []
    for para in head.split("\n\n"):
        if para.startswith("\b"):
            out.append(para)
            continue
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not _ITEM.match(line):
                lines[-1] = f"{lines[-1]} {line.strip()}"
            else:
                lines.append(line.rstrip())
        out.append("\n".join(lines))
    return "\n\n".join(out) + cut + tail


def reflow_help(command: Any) -> None:
    """:func:`reflow` the help of ``command`` (a click command of typer's) and of every command
    under it (typer's command list would otherwise break a description where its docstring's
    source line ends). A command without a short help gets its help's first paragraph as one:
    a group's command list shows it whole, wrapped (click would cut it to one line)."""
    if command.help:
        command.help = reflow(command.help)
        first = command.help.split("\f")[0].split("\n\n")[0].strip()
        if not command.short_help and first and not first.startswith("\b"):
            command.short_help = first
    for sub in getattr(command, "commands", {}).values():
        reflow_help(sub)


def _report(exc: Exception) -> int:
    """Print ``exc`` as one line (or the help it stands for); its exit code."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # the help text, as asked for
        exc.show()  # type: ignore[attr-defined]  # click's NoArgsIsHelpError, matched by name
        return int(getattr(exc, "exit_code", 2))
    if isinstance(exc, typer.Abort):
        typer.echo("error: aborted", err=True)
        return 1
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # click's usage errors
        typer.echo(f"error: {one_line(exc.format_message())}", err=True)
        return int(exc.exit_code)
    typer.echo(f"error: internal error: {one_line(f'{type(exc).__name__}: {exc}')}", err=True)
    return 1


async def with_bus(
    nats_url: str | None,
    fn: Callable[[Any], Awaitable[T]],
    *,
    name: str = "cli",
    role: str = "client",
    creds: str | None = None,
    paths: RunPaths | None = None,
) -> T:
    """Connect (no reconnect loops: a CLI should fail fast), run ``fn(nc)``, close. The
    credentials are ``creds`` (``--creds``), else ``$BELAYER_CREDS``, else the running node's
    identity of ``role`` (``client``; ``operator`` for sandboxes and ``down``) from its run
    directory (``common.node.resolve_bus``)."""
    url, bus = resolve_bus(nats_url, creds=creds, role=role, paths=paths)
    nc = await connect(url, name=name, bus=bus, timeout=3.0, reconnect=False)
    try:
        return await fn(nc)
    finally:
        await nc.drain()


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
