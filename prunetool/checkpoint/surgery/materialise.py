"""PyTorch `.bin` checkpoints: re-save them once as safetensors so the byte-level rewrite applies.

Only the `.bin` case loads the model: pickled weights cannot be read tensor by tensor, and loading
them through transformers (weights-only unpickling, legacy key renames) is the supported way in. The
temporary copy lives beside the output and is deleted whatever happens.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prunetool.errors import ModelSourceError
from prunetool.checkpoint_io import hidden_sibling, remove_tree
from prunetool.sources.checks import SAFETENSORS_INDEX
from prunetool.sources.weights import has_safetensors


@contextmanager
def safetensors_folder(source: Path, output: Path) -> Iterator[Path]:
    """Yield a folder with safetensors weights for `source`: itself, or a temporary re-save of its .bin."""
    if has_safetensors(source):
        yield source
        return
    if not sorted(source.glob("pytorch_model*.bin")):
        raise ModelSourceError(
            f"{source} has no weights: expected model.safetensors, {SAFETENSORS_INDEX} or pytorch_model*.bin"
        )
    scratch = hidden_sibling(output, "safetensors")
    try:
        save_as_safetensors(source, scratch)
        yield scratch
    finally:
        remove_tree(scratch)


def save_as_safetensors(source: Path, target: Path) -> None:
    """Load the .bin checkpoint in its own dtype and save it with transformers' safetensors writer."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelSourceError(f"cannot load the .bin weights in {source}: {e}") from e
    model.save_pretrained(target)
