"""The pruned checkpoint's folder: refuse dangerous targets, copy side files, add prunetool's own.

The folder itself is built beside its target and renamed into place by checkpoint_io.staged_folder, so
an interrupted or failed run leaves neither a half-written output nor a stray temporary folder.
"""

import shutil
from pathlib import Path

from prunetool.checkpoint_io import check_free_folder
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
