"""Progress on stderr: one bar style for every stage that walks windows, candidates, shards or tasks."""

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def window_progress(console: Console) -> Progress:
    """A transient bar (gone once done) so stdout stays clean for results."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console, transient=True,
    )
