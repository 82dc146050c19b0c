"""`prunetool export FOLDER --gguf OUT.gguf`: a pruned or healed folder as one GGUF file for llama.cpp.

Progress goes to the given console (stderr); the result is returned for the CLI to print on stdout.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from prunetool.checkpoint.gguf.layout import layers_named
from prunetool.errors import OptionError
from prunetool.progress import window_progress


def run_export(folder: Path, *, gguf: Path | None, type_name: str, force: bool, console: Console) -> dict:
    """Export `folder` to `gguf` in `type_name` storage; returns ExportResult.to_json()."""
    if gguf is None:
        raise OptionError("give --gguf OUT.gguf: the file to write (GGUF is the one export format)")
    from prunetool.checkpoint.gguf import prepare_export, write_export

    prepared = prepare_export(folder, gguf, type_name, force=force)
    with window_progress(console) as progress:
        task = progress.add_task(f"writing {prepared.output.name}", total=len(prepared.tensors))
        result = write_export(prepared, on_tensor=lambda done, total: progress.update(task, completed=done))
    for note in result.notes:
        console.print(f"note: {note}", style="yellow", highlight=False, soft_wrap=True)
    return result.to_json()


def summary_line(result: dict) -> str:
    """One line for people: what was written, from which layers."""
    size = result["bytes"] / 2**20
    layers = len(result["source_layers"])
    line = (f"wrote {result['output']}: {result['architecture']}, {result['type']}, {layers} layers, "
            f"{result['tensors']} tensors, {size:.1f} MiB; vocabulary {result['vocab']}")
    if result["dropped_layers"]:
        line += f"; left out (identity): {layers_named(result['dropped_layers'])}"
    if result["zero_ffn_layers"]:
        line += f"; zero MLP added to {layers_named(result['zero_ffn_layers'])}"
    return line
