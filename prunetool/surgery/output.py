"""The output folder: refuse dangerous targets, build beside it, publish with renames, copy side files.

Everything is written into a hidden folder next to the output (same file system, so the final step
is a rename) and only renamed into place once complete. An interrupted or failed run therefore
leaves neither a half-written output nor a stray temporary folder, and `force` swaps an old output
out only after the new one is whole.
"""

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prunetool.errors import OptionError

# Weight formats: the pruned tensors are written separately; stale copies of the full model must not follow.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
NOT_COPIED = {
    "config.json",  # rewritten
    "README.md",  # the CLI writes the pruned model's own card
    "prunetool_source.json",  # provenance of the *source* conversion in prunetool's cache
    "params.json",  # Mistral's native config for consolidated.safetensors, which is not written
}


def check_output(source: Path, output: Path, force: bool) -> None:
    """Refuse an output that is, holds or lies inside the source, a file, or a non-empty folder without force."""
    src, out = source.resolve(), output.resolve()
    if out == src or src in out.parents:
        raise OptionError(f"output {output} is the source folder or inside it; choose a folder outside {source}")
    if out in src.parents:
        raise OptionError(f"output {output} contains the source folder {source}; choose another output folder")
    check_free_folder(output, force)


def check_free_folder(output: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder without force: checked before any slow work starts."""
    if output.exists() and not output.is_dir():
        raise OptionError(f"output {output} exists and is not a folder; choose a folder name")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise OptionError(
            f"output {output} exists and is not empty; choose another folder or pass --force to replace it"
        )


def hidden_sibling(path: Path, tag: str) -> Path:
    """Create and return a new empty folder `.{name}.{tag}-XXXXXXXX` beside `path` (honours the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = path.parent / f".{path.name}.{tag}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_folder(output: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `output`; on success rename it to `output`, on any error delete it."""
    staging = hidden_sibling(output, "tmp")
    try:
        yield staging
        publish(staging, output, force)
    except BaseException:  # includes KeyboardInterrupt: nothing half-written may remain
        remove_tree(staging)
        raise


def publish(staging: Path, output: Path, force: bool) -> None:
    """Rename the finished folder into place; an existing output is moved aside first and deleted last."""
    if output.is_symlink() or output.exists():
        if output.is_dir() and not output.is_symlink() and not any(output.iterdir()):
            output.rmdir()
        elif not force:
            raise OptionError(f"output {output} appeared while writing; choose another folder or pass --force")
        else:
            aside = output.parent / f".{output.name}.old-{secrets.token_hex(4)}"
            os.rename(output, aside)
            try:
                os.rename(staging, output)
            except BaseException:
                os.rename(aside, output)  # put the old output back
                raise
            remove_tree(aside)
            return
    os.rename(staging, output)


def copy_side_files(source: Path, target: Path) -> list[str]:
    """Copy the source folder's top-level non-weight files byte for byte; return their names.

    Sub-folders are skipped: on the Hub they hold other weight formats (original/, onnx/, gguf/).
    """
    copied = []
    for path in sorted(source.iterdir()):
        name = path.name
        if not path.is_file() or name in NOT_COPIED or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        shutil.copyfile(path, target / name)  # follows symlinks (Hub cache snapshots link to blobs)
        copied.append(name)
    return copied


def check_extra_names(extra_files: dict[str, str] | None, reserved: set[str]) -> None:
    """Extra files must stay inside the output and must not replace the weights or the config."""
    for name in extra_files or {}:
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise OptionError(f"extra file name {name!r} must be a relative path inside the output folder")
        if name in reserved or name.endswith(WEIGHT_SUFFIXES):
            raise OptionError(f"extra file {name!r} would replace the pruned weights or config; rename it")


def write_extra_files(target: Path, extra_files: dict[str, str] | None) -> None:
    for name, text in (extra_files or {}).items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
