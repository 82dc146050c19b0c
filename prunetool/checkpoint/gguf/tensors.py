"""The GGUF's tensors: names, storage types and the value changes llama.cpp's graphs expect.

Every tensor is planned from the safetensors headers first (name, shape, type, byte size), so the file's
tensor index is written before any weight is read; each weight is then read, changed and encoded alone.

Value changes, as llama.cpp's own converter makes them:
* llama and deci apply RoPE to interleaved pairs where transformers rotates halves: q_proj and k_proj rows
  (and their biases) are permuted per head;
* Gemma's RMSNorm multiplies by (1 + w): every norm weight is stored as w + 1;
* storage: 1-D tensors, norms and biases stay float32; a q8_0 tensor whose rows are not a multiple of 32
  values is stored as float16.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import gguf
import numpy as np

from prunetool.checkpoint.gguf.layout import Layout
from prunetool.checkpoint.gguf.source import Source
from prunetool.errors import ModelSourceError, UnsupportedModelError

Q = gguf.GGMLQuantizationType
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
ZERO_FFN = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: its name, its shape in transformers' (rows, columns) order, its type and its values."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    values: Callable[[], np.ndarray]  # float32, already changed for llama.cpp
    source: str | None  # the folder's tensor name; None for tensors export makes (zero MLPs, rope_freqs)

    @property
    def nbytes(self) -> int:
        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


def storage_type(name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The type a tensor is stored in: float32 for vectors, norms and biases; float16 where q8_0 cannot hold it."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    if wanted == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16
    return wanted


def interleave_rope_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from transformers' rotate-half order (x0..x_{d/2-1}, y0..) to GGML's pairs (x0, y0, x1..)."""
    rows = weights.shape[0]
    return (weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def value_change(layout: Layout, block_heads: tuple[int, int] | None, rest: str) -> Callable[[np.ndarray], np.ndarray]:
    """What happens to one tensor's values on the way to llama.cpp (rest: the name after `model.layers.N.`)."""
    changes: list[Callable[[np.ndarray], np.ndarray]] = []
    if layout.permute_qk and block_heads is not None:
        heads, kv_heads = block_heads
        if rest.startswith("self_attn.q_proj."):
            changes.append(lambda w: interleave_rope_rows(w, heads))
        elif rest.startswith("self_attn.k_proj."):
            changes.append(lambda w: interleave_rope_rows(w, kv_heads))
    if layout.norm_shift and rest.endswith("norm.weight"):
        changes.append(lambda w: w + np.float32(layout.norm_shift))
    if layout.q_norm_scale != 1.0 and rest == "self_attn.q_norm.weight":
        changes.append(lambda w: w * np.float32(layout.q_norm_scale))

    def apply(values: np.ndarray) -> np.ndarray:
        for change in changes:
            values = change(values)
        return values

    return apply


def gguf_name(names: gguf.TensorNameMap, canonical: str) -> str:
    mapped = names.get_name(canonical, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise UnsupportedModelError(f"tensor {canonical} has no llama.cpp counterpart in this architecture; export "
                                    "refuses rather than drop it")
    return mapped


class TensorReader:
    """Opens each shard on first use (until the `with` block ends) and reads one tensor at a time as float32."""

    def __init__(self):
        self.stack, self.handles = ExitStack(), {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()
        self.handles.clear()

    def read(self, source: Source, canonical: str) -> np.ndarray:
        import torch  # safetensors' numpy reader has no bfloat16
        from safetensors import safe_open

        where = source.tensors[canonical]
        if where.path not in self.handles:
            self.handles[where.path] = self.stack.enter_context(safe_open(str(where.path), framework="pt"))
        return self.handles[where.path].get_tensor(where.name).to(torch.float32).numpy()


def planned(name, shape, wanted, values, source=None) -> PlannedTensor:
    return PlannedTensor(name, tuple(shape), storage_type(name, tuple(shape), wanted), values, source)


def read_with(reader: TensorReader, source: Source, canonical: str, change) -> Callable[[], np.ndarray]:
    return lambda: change(reader.read(source, canonical))


def block_tensors(source: Source, layout: Layout, reader: TensorReader, names, wanted, index: int) -> list:
    """One GGUF block's tensors from its folder layer, plus a zero MLP where the layout asks for one."""
    block = layout.blocks[index]
    prefix = f"model.layers.{block.source}."
    found = sorted(name for name in source.tensors if name.startswith(prefix))
    tensors = []
    for canonical in found:
        rest = canonical[len(prefix):]
        change = value_change(layout, (block.heads, block.kv_heads) if block.heads else None, rest)
        tensors.append(planned(gguf_name(names, f"model.layers.{index}.{rest}"), source.tensors[canonical].shape,
                               wanted, read_with(reader, source, canonical, change), canonical))
    if block.zero_ffn:
        tensors += zero_ffn_tensors(names, index, source.config.hidden_size, block.ffn, wanted)
    return tensors


def zero_ffn_tensors(names, index: int, hidden: int, width: int, wanted) -> list[PlannedTensor]:
    """An MLP whose output is exactly 0 (zero projections), with a norm of ones, for llama.cpp's deci graph."""
    shapes = {"mlp.gate_proj.weight": (width, hidden), "mlp.up_proj.weight": (width, hidden),
              "mlp.down_proj.weight": (hidden, width), "post_attention_layernorm.weight": (hidden,)}
    tensors = []
    for rest in ZERO_FFN:
        shape = shapes[rest]
        fill = np.ones if rest.endswith("norm.weight") else np.zeros
        tensors.append(planned(gguf_name(names, f"model.layers.{index}.{rest}"), shape, wanted,
                               lambda shape=shape, fill=fill: fill(shape, dtype=np.float32)))
    return tensors


def outer_tensors(source: Source, layout: Layout, reader: TensorReader, names, wanted) -> tuple[list, list]:
    """Embedding first; final norm, output head (unless tied) and rope_freqs last."""
    tensors = source.tensors
    if "model.embed_tokens.weight" not in tensors or "model.norm.weight" not in tensors:
        raise ModelSourceError(f"{source.folder} lacks the embedding or final norm (model.embed_tokens.weight, "
                               "model.norm.weight under the decoder's prefix)")
    first = [planned("token_embd.weight", tensors["model.embed_tokens.weight"].shape, wanted,
                     read_with(reader, source, "model.embed_tokens.weight", lambda w: w), "model.embed_tokens.weight")]
    shift = value_change(layout, None, "norm.weight")
    last = [planned("output_norm.weight", tensors["model.norm.weight"].shape, wanted,
                    read_with(reader, source, "model.norm.weight", shift), "model.norm.weight")]
    if "lm_head.weight" in tensors and not tied_embeddings(source):
        last.append(planned("output.weight", tensors["lm_head.weight"].shape, wanted,
                            read_with(reader, source, "lm_head.weight", lambda w: w), "lm_head.weight"))
    if layout.rope_factors is not None:
        factors = np.array(layout.rope_factors, dtype=np.float32)
        last.append(planned(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.shape, wanted,
                            lambda: factors))
    return first, last


def tied_embeddings(source: Source) -> bool:
    """Whether transformers uses the embedding as the output head (then lm_head, if saved, is a copy)."""
    top = source.raw_config.get("tie_word_embeddings")
    tied = getattr(source.config, "tie_word_embeddings", None)
    tied = top if top is not None else tied
    if not tied and "lm_head.weight" not in source.tensors:
        raise ModelSourceError(f"{source.folder} has no lm_head.weight although tie_word_embeddings is false")
    return bool(tied)


def plan_tensors(source: Source, layout: Layout, reader: TensorReader, wanted) -> list[PlannedTensor]:
    """Every tensor of the GGUF in writing order; every decoder tensor of the kept layers is used exactly once."""
    names = gguf.get_tensor_name_map(layout.arch, len(layout.blocks))
    first, last = outer_tensors(source, layout, reader, names, wanted)
    blocks = [tensor for index in range(len(layout.blocks))
              for tensor in block_tensors(source, layout, reader, names, wanted, index)]
    plan = first + blocks + last
    check_all_used(source, layout, plan)
    return plan


def check_all_used(source: Source, layout: Layout, plan: list[PlannedTensor]) -> None:
    """Refuse a folder holding decoder tensors the layout has no place for (e.g. a removed sublayer's weights)."""
    used = {tensor.source for tensor in plan} | {"lm_head.weight"}
    dropped = {f"model.layers.{index}." for index in layout.dropped}
    unused = sorted(name for name in source.tensors if name not in used and not name.startswith(tuple(dropped)))
    if unused:
        raise ModelSourceError(f"{source.folder} holds {unused[0]}, which its config.json does not describe "
                               f"({len(unused)} such tensors); export refuses rather than guess")
    stray = sorted(name for name in source.tensors if name.startswith(tuple(dropped)))
    if stray:
        raise ModelSourceError(f"{source.folder} holds {stray[0]} for a layer whose sublayers are all removed")


def required_shapes(layout: Layout, index: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors llama.cpp requires of GGUF block `index`, with the shapes it checks at load time."""
    block, width = layout.blocks[index], layout.blocks[index].ffn
    shapes = {"ffn_norm.weight": (hidden,), "ffn_gate.weight": (width, hidden), "ffn_up.weight": (width, hidden),
              "ffn_down.weight": (hidden, width)}
    if block.heads:
        query, key_value = block.heads * layout.head_dim, block.kv_heads * layout.head_dim
        shapes |= {"attn_norm.weight": (hidden,), "attn_q.weight": (query, hidden),
                   "attn_k.weight": (key_value, hidden), "attn_v.weight": (key_value, hidden),
                   "attn_output.weight": (hidden, query)}
    return {f"blk.{index}.{name}": shape for name, shape in shapes.items()}


def check_shapes(layout: Layout, plan: list[PlannedTensor], hidden: int) -> None:
    """What llama.cpp checks when it loads the file, checked here so a bad folder fails before writing."""
    found = {tensor.name: tensor for tensor in plan}
    for index, block in enumerate(layout.blocks):
        for name, shape in required_shapes(layout, index, hidden).items():
            if name not in found:
                raise ModelSourceError(f"layer {block.source} lacks the tensor llama.cpp loads as {name}")
            if found[name].shape != shape:
                raise ModelSourceError(f"{found[name].source} has shape {list(found[name].shape)}, but config.json "
                                       f"describes {list(shape)} for layer {block.source}")


def encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The stored bytes (as gguf's reference encoders give them, bit-exact with ggml's)."""
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
