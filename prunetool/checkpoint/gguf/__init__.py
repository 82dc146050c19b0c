"""A folder prune or heal wrote -> one GGUF file that llama.cpp runs, computing what transformers computes.

    result = export_gguf(folder, "model.gguf", "q8_0")

Steps, each its own module: `source` reads config.json and the tensor headers; `layout` picks llama.cpp's
architecture and hyperparameters (and refuses what llama.cpp would compute differently); `vocab` turns
tokenizer.json into llama.cpp's vocabulary; `tensors` plans every tensor's name, type and value changes;
`writer` writes the file atomically. Nothing in the source folder is written to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf

from prunetool import __version__
from prunetool.checkpoint.gguf.layout import Layout, plan_layout
from prunetool.checkpoint.gguf.source import read_source
from prunetool.checkpoint.gguf.tensors import FILE_TYPES, TYPES, TensorReader, check_shapes, plan_tensors
from prunetool.checkpoint.gguf.vocab import Vocab, read_vocab, special_vocab, vocab_calls
from prunetool.checkpoint.gguf.writer import KeyValue, check_output, write_gguf
from prunetool.errors import OptionError

__all__ = ["GGUF_TYPES", "ExportResult", "export_gguf", "prepare_export", "write_export"]
GGUF_TYPES = tuple(TYPES)


@dataclass
class ExportResult:
    """What was written: shown by `prunetool export` and returned as its --json."""

    output: str
    architecture: str
    type: str
    bytes: int
    tensors: int
    source_layers: list[int]  # GGUF block i holds the folder's layer source_layers[i]
    dropped_layers: list[int]
    zero_ffn_layers: list[int]
    vocab: str
    stored_types: dict[str, int]  # tensor count per storage type (f32 norms, f16 fallbacks, ...)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def check_type(name: str) -> gguf.GGMLQuantizationType:
    if name not in TYPES:
        raise OptionError(f"--type {name!r} is not one of {', '.join(TYPES)}")
    return TYPES[name]


def general_calls(folder: Path, layout: Layout, type_name: str, notes: list[str]) -> list[tuple[str, object]]:
    """general.* keys and prunetool.* keys that record what export changed."""
    calls: list[tuple[str, object]] = [
        ("add_type", gguf.GGUFType.MODEL), ("add_name", folder.name), ("add_file_type", FILE_TYPES[type_name]),
        ("add_quantization_version", gguf.GGML_QUANT_VERSION),
        ("add_description", f"exported by prunetool {__version__} from {folder.name}"
                            + "".join(f"; {note}" for note in notes)),
        ("add_string", KeyValue("prunetool.version", __version__)),
        ("add_array", KeyValue("prunetool.source_layers", [block.source for block in layout.blocks])),
    ]
    if layout.dropped:
        calls.append(("add_array", KeyValue("prunetool.dropped_layers", list(layout.dropped))))
    if layout.zero_ffn_layers:
        calls.append(("add_array", KeyValue("prunetool.zero_ffn_layers", list(layout.zero_ffn_layers))))
    return calls


def stored_types(tensors) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors:
        counts[tensor.qtype.name.lower()] = counts.get(tensor.qtype.name.lower(), 0) + 1
    return counts


@dataclass(frozen=True)
class PreparedExport:
    """Everything checked and planned; writing is all that is left."""

    output: Path
    type_name: str
    layout: Layout
    vocab: Vocab
    calls: list
    special: gguf.SpecialVocab
    tensors: list
    reader: TensorReader
    notes: list[str]


def prepare_export(folder: Path, output: Path, type_name: str = "f32", *, force: bool = False) -> PreparedExport:
    """Check the folder, the output and the options, and plan the file; every refusal happens here."""
    wanted = check_type(type_name)
    source = read_source(folder)
    output = check_output(output, source.folder, force)
    layout = plan_layout(source.config, {name: tensor.shape for name, tensor in source.tensors.items()},
                         wrapped=source.wrapped)
    vocab = read_vocab(source.folder, source.config.vocab_size)
    notes = list(layout.notes)
    if source.left_out:
        notes.append(f"{len(source.left_out)} tensors outside the text decoder left out (e.g. {source.left_out[0]})")
    reader = TensorReader()
    tensors = plan_tensors(source, layout, reader, wanted)
    check_shapes(layout, tensors, source.config.hidden_size)
    calls = general_calls(source.folder, layout, type_name, notes) + list(layout.hparams) + vocab_calls(vocab)
    return PreparedExport(output, type_name, layout, vocab, calls, special_vocab(source.folder, vocab), tensors,
                          reader, notes)


def write_export(prepared: PreparedExport, on_tensor=None) -> ExportResult:
    """Write a prepared export; `on_tensor(done, total)` follows the tensors."""
    layout = prepared.layout
    with prepared.reader:
        size = write_gguf(prepared.output, layout.arch_name, prepared.calls, prepared.special, prepared.tensors,
                          on_tensor)
    return ExportResult(str(prepared.output), layout.arch_name, prepared.type_name, size, len(prepared.tensors),
                        [block.source for block in layout.blocks], list(layout.dropped), list(layout.zero_ffn_layers),
                        prepared.vocab.describe(), stored_types(prepared.tensors), prepared.notes)


def export_gguf(folder: Path, output: Path, type_name: str = "f32", *, force: bool = False,
                on_tensor=None) -> ExportResult:
    """Export `folder` to the GGUF file `output`; every refusal happens before the first byte is written."""
    return write_export(prepare_export(folder, output, type_name, force=force), on_tensor)
