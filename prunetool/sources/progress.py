"""Progress lines on stderr, so stdout stays clean for tables and JSON output."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console


def _console() -> Console:
    """Bound to the stderr of the moment: pytest and redirections swap sys.stderr."""
    return Console(file=sys.stderr)


@contextmanager
def step(message: str) -> Iterator[None]:
    """A spinner on a terminal; a plain line otherwise, so CI logs keep the trail."""
    console = _console()
    if console.is_terminal:
        with console.status(message):
            yield
    else:
        console.print(f"{message} ...", highlight=False, markup=False)
        yield


def note(message: str) -> None:
    """A one-line remark that does not stop the run."""
    _console().print(f"note: {message}", style="yellow", highlight=False, markup=False)
