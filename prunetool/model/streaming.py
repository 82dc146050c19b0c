"""Score a model without holding it: one decoder layer in memory at a time, read from safetensors.

The way sequential quantisers work, with transformers doing the architecture-specific parts:

* The model is built on the meta device (no memory), so its own forward still computes masks, rotary
  tables and the per-layer-type arguments exactly as a loaded model does.
* Non-persistent buffers outside the layers (rotary frequencies, Gemma's embedding scale) are
  materialised and recomputed with the model's own `_init_weights`; the final norm is read.
* The embedding table is cut down to the rows the calibration windows use (read from the file,
  never the whole table: Gemma 3's is 63% of its checkpoint) and the windows are renumbered into it.
* A forward pre-hook reads each decoder layer's tensors just before it runs, a forward hook returns
  it to the meta device right after. Each batch of windows reads every layer again: re-reading costs
  little (the file stays in the page cache, which is not this process's memory), while one batch of
  all windows would cost more activation memory than the layers save. The score hooks (capture.py)
  see the same tensors as in the default path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import nn

from prunetool.model.architecture import decoder_of
from prunetool.errors import UnsupportedModelError
from prunetool.memory import return_freed_memory
from prunetool.model import perplexity as windowed
from prunetool.model.perplexity import perplexity_from_mean
from prunetool.model.runner import SCREEN_DTYPE, ModelRunner, native_bfloat16, removed_units
from prunetool.sources.weights import find_decoder_prefix, read_weights


DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _read_exact(path, offset: int, view: memoryview) -> None:
    """Fill `view` with the bytes of `path` from `offset` (plain reads, no memory map)."""
    with open(path, "rb", buffering=0) as stream:
        stream.seek(offset)
        done = 0
        while done < len(view):
            got = stream.readinto(view[done:])
            if not got:
                raise UnsupportedModelError(f"{path} ended early while reading; re-download the model")
            done += got


class CheckpointReader:
    """Tensors by name from a (possibly sharded) safetensors checkpoint, read with plain file reads.

    Not memory-mapped: pages of a mapped file that a copy touched stay in the process's resident set,
    so mapping the checkpoint would bring the whole model into RSS after all.
    """

    def __init__(self, folder):
        self.folder = folder
        weights = read_weights(folder)
        self.entries = {entry.name: (shard, entry) for shard in weights.shards for entry in shard.entries}
        self.names = list(self.entries)

    def _entry(self, name: str):
        if name not in self.entries:
            raise UnsupportedModelError(f"low-memory scoring expected a tensor named {name} in the checkpoint; "
                                        "score without --low-memory")
        shard, entry = self.entries[name]
        dtype = DTYPES.get(entry.info["dtype"])
        if dtype is None:
            raise UnsupportedModelError(f"low-memory scoring cannot read {name} ({entry.info['dtype']}); "
                                        "score without --low-memory")
        return shard, entry, dtype

    def _read(self, path, offset: int, length: int) -> bytearray:
        buffer = bytearray(length)
        _read_exact(path, offset, memoryview(buffer))
        return buffer

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Fill `target` (contiguous, CPU) with the tensor's bytes, converting dtype only when they differ."""
        shard, entry, dtype = self._entry(name)
        if list(target.shape) != list(entry.info["shape"]):
            raise UnsupportedModelError(f"{name} has shape {entry.info['shape']} in the checkpoint but the model "
                                        f"expects {list(target.shape)}")
        if dtype != target.dtype or target.numel() == 0:
            target.copy_(self.tensor(name))
            return
        start, _ = entry.info["data_offsets"]
        _read_exact(shard.path, shard.data_start + start, memoryview(target.view(-1).view(torch.uint8).numpy()))

    def tensor(self, name: str) -> torch.Tensor:
        shard, entry, dtype = self._entry(name)
        start, end = entry.info["data_offsets"]
        data = self._read(shard.path, shard.data_start + start, end - start)
        return torch.frombuffer(data, dtype=dtype).reshape(entry.info["shape"]) if end > start else \
            torch.empty(entry.info["shape"], dtype=dtype)

    def rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` (sorted, unique) of a 2-D tensor, reading each contiguous run once."""
        shard, entry, dtype = self._entry(name)
        rows_total, width = entry.info["shape"]
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        base = shard.data_start + entry.info["data_offsets"][0]
        result = torch.empty((len(indices), width), dtype=dtype)  # filled in place: no second copy
        raw = memoryview(result.view(-1).view(torch.uint8).numpy())
        start = 0
        values = indices.tolist()
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[i - 1] + 1:
                first, count = values[start], values[i - 1] + 1 - values[start]
                _read_exact(shard.path, base + first * row_bytes, raw[start * row_bytes:(start + count) * row_bytes])
                start = i
        return result


def _load_module(module: nn.Module, reader: CheckpointReader, prefix: str, dtype, device, init_weights) -> None:
    """Give a non-layer module real storage, read its parameters and persistent buffers, recompute the others."""
    module.to_empty(device=device)
    for submodule in module.modules():  # first: _init_weights may also (randomly) fill the module's parameters
        if submodule._non_persistent_buffers_set:
            init_weights(submodule)
    with torch.no_grad():
        for name, target in _persistent(module).items():
            reader.read_into(prefix + name, target)


def _persistent(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and the buffers a checkpoint stores, by name relative to `module`."""
    return dict(module.named_parameters()) | {
        name: buffer for name, buffer in module.named_buffers()
        if name.rpartition(".")[2] not in _owner(module, name)._non_persistent_buffers_set
    }


def _owner(module: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    return module.get_submodule(path) if path else module


class LayerStreamer:
    """Loads a decoder layer's tensors just before it runs and releases them right after.

    Released storage goes to a pool keyed by shape and dtype and is refilled for the next layer, so the
    run allocates one layer's worth of weights once instead of churning the allocator (which, with
    glibc, left freed layers in the heap and grew the resident set by the size of the model).
    """

    def __init__(self, reader: CheckpointReader, layer_prefix: str, dtype, device, init_weights):
        self.reader, self.layer_prefix, self.dtype, self.device = reader, layer_prefix, dtype, device
        self.init_weights = init_weights
        self.pool: dict[tuple, list[torch.Tensor]] = {}
        self.overrides: dict[str, torch.Tensor] = {}  # checkpoint name -> tensor used instead of the file's

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        free = self.pool.get((tuple(like.shape), like.dtype))
        return free.pop() if free else torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def load(self, index: int, layer: nn.Module) -> None:
        prefix = f"{self.layer_prefix}{index}."
        for submodule in layer.modules():
            if submodule._non_persistent_buffers_set:  # rare inside layers; recomputed from the config
                submodule.to_empty(device=self.device, recurse=False)
                self.init_weights(submodule)
        with torch.no_grad():
            for name, meta in _persistent(layer).items():
                storage = self._take(meta)
                if prefix + name in self.overrides:  # a patched tensor, cast to this model's dtype as a reload would
                    storage.copy_(self.overrides[prefix + name])
                else:
                    self.reader.read_into(prefix + name, storage)
                owner, attribute = _owner(layer, name), name.rpartition(".")[2]
                if attribute in owner._parameters:
                    owner._parameters[attribute] = nn.Parameter(storage, requires_grad=False)
                else:
                    owner._buffers[attribute] = storage

    def release(self, layer: nn.Module) -> None:
        for name, tensor in _persistent(layer).items():
            self.pool.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor.data)
            owner, attribute = _owner(layer, name), name.rpartition(".")[2]
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            if attribute in owner._parameters:
                owner._parameters[attribute] = nn.Parameter(meta, requires_grad=False)
            else:
                owner._buffers[attribute] = meta
        return_freed_memory()


@dataclasses.dataclass
class StreamedModel(ModelRunner):
    """The ModelRunner of prune --low-memory: a meta-device model whose layers load themselves when called;
    its embedding holds only the rows of the windows it was built for, and its head is read from disk."""

    holds_embedding_table: ClassVar[bool] = False  # only the calibration rows: a patch cannot fold into it
    head_from_disk: ClassVar[bool] = True

    model: nn.Module
    remapped_ids: torch.Tensor  # calibration windows renumbered into the cut-down embedding table
    device: torch.device
    reader: CheckpointReader | None = None
    head_name: str | None = None  # the LM head's tensor in the checkpoint (the embedding's when tied)
    used: torch.Tensor | None = None  # sorted token ids the embedding table holds, in its row order
    streamer: LayerStreamer | None = None

    @contextlib.contextmanager
    def layer_loaded(self, index: int):
        """Layer `index` holds its real weights inside the block (for code that reads them, like the patch fit)."""
        layer = decoder_of(self.model).layers[index]
        self.streamer.load(index, layer)
        try:
            yield layer
        finally:
            self.streamer.release(layer)

    def replace_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Decoder-relative tensors (e.g. `layers.5.mlp.down_proj.weight`) used instead of the checkpoint's
        whenever their layer loads from now on; only decoder-layer tensors can be replaced."""
        prefix = self.streamer.layer_prefix.removesuffix("layers.")
        if any(not name.startswith("layers.") for name in tensors):
            raise ValueError("only decoder-layer tensors can be replaced on a streamed model")
        self.streamer.overrides.update({prefix + name: value for name, value in tensors.items()})

    @contextlib.contextmanager
    def tensors_replaced(self, tensors: dict[str, torch.Tensor]):
        """replace_tensors for the duration of the block only."""
        saved = dict(self.streamer.overrides)
        self.replace_tensors({name: value.to(self.model.dtype) for name, value in tensors.items()})
        try:
            yield
        finally:
            self.streamer.overrides = saved

    def input_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.remap(ids)

    def remap(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> rows of the cut-down embedding; only ids the model was built for."""
        rows = torch.searchsorted(self.used, ids.contiguous())
        if bool((rows >= len(self.used)).any()) or not torch.equal(self.used[rows.clamp(max=len(self.used) - 1)], ids):
            raise ValueError("these windows use token ids the streamed model was not built for")
        return rows

    def head_nll_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> float:
        """Summed NLL of `targets` (N,) under the LM head applied to normed `hidden` (N, d), the head read
        from the checkpoint a block of vocabulary rows at a time (a log-sum-exp accumulated over blocks)."""
        vocab = self.reader.entries[self.head_name][1].info["shape"][0]
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        # a sixteenth of the in-memory path's logits budget, for the logits and for the head rows read at once
        # (log-sum-exp doubles the first, the dtype cast the second; memory is the point here)
        block = max(1, windowed.LOGITS_BUDGET_BYTES // (16 * 4 * max(hidden.shape[0], hidden.shape[1])))
        targets = targets.to(hidden.device)
        log_total = torch.full((hidden.shape[0],), -torch.inf, device=hidden.device)
        target_logit = torch.zeros(hidden.shape[0], device=hidden.device)
        with torch.inference_mode():
            for first in range(0, vocab, block):
                last = min(vocab, first + block)
                rows = self.reader.rows(self.head_name, torch.arange(first, last)).to(hidden.device, hidden.dtype)
                logits = hidden @ rows.T
                if cap is not None:  # in the model dtype, before the float32 upcast, as the model does
                    logits = torch.tanh(logits / cap) * cap
                logits = logits.float()
                log_total = torch.logaddexp(log_total, torch.logsumexp(logits, dim=1))
                inside = (targets >= first) & (targets < last)
                target_logit[inside] = logits[inside, targets[inside] - first]
        return (log_total - target_logit).double().sum().item()

    def perplexity(self, windows: torch.Tensor, *, cut=None, batch_size: int = 1) -> float:
        """`perplexity()` of the model under `cut`, one decoder layer in memory at a time;
        the head runs once over the final hidden states of all windows (so it is read once)."""
        hidden = []
        inputs = self.remap(windows)
        with torch.inference_mode(), removed_units(self.model, cut):
            for start in range(0, windows.shape[0], batch_size):
                batch = inputs[start:start + batch_size].to(self.device)
                states = decoder_of(self.model)(input_ids=batch, use_cache=False).last_hidden_state
                hidden.append(states[:, :-1].reshape(-1, states.shape[-1]))
        total = self.head_nll_sum(torch.cat(hidden), windows[:, 1:].reshape(-1))
        return perplexity_from_mean(total / (windows.shape[0] * (windows.shape[1] - 1)))


    def screening_copy(self) -> ModelRunner:
        """A second streamed skeleton whose layers load in bfloat16 (where that is native), the same rounding
        of the same checkpoint; this model itself when it is not float32."""
        if self.model.dtype != torch.float32 or self.reader is None or not native_bfloat16(self.device):
            return self
        return build_streamed(SimpleNamespace(path=self.reader.folder), self.used, dtype=SCREEN_DTYPE,
                              device=self.device, attn_implementation=self.model.config._attn_implementation)


def build_streamed(source, input_ids: torch.Tensor, *, dtype: torch.dtype, device: torch.device,
                   attn_implementation: str | None = None) -> StreamedModel:
    """A meta-device model whose non-layer parts are real and whose layers load themselves when called."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source.path)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    model.eval()
    decoder = decoder_of(model)
    text_config = model.config.get_text_config(decoder=True)
    reader = CheckpointReader(source.path)
    layer_prefix = find_decoder_prefix(reader.names, text_config.num_hidden_layers)  # e.g. "model.layers."
    prefix = layer_prefix.removesuffix("layers.")

    embed = decoder.get_input_embeddings()
    used = torch.unique(input_ids)
    embed_name = next(name for name, param in decoder.named_parameters() if param is embed.weight)
    rows = reader.rows(prefix + embed_name, used).to(dtype)
    embed.weight = nn.Parameter(torch.empty_like(rows, device=device), requires_grad=False)
    embed.padding_idx = None  # the renumbered table has no padding row; it only matters for gradients
    embed.num_embeddings = len(used)
    for name, module in decoder.named_children():
        if name == "layers":
            continue
        if module is embed:
            embed.to_empty(device=device)
            for submodule in embed.modules():
                if submodule._non_persistent_buffers_set:
                    model._init_weights(submodule)
            with torch.no_grad():
                embed.weight.copy_(rows)
        else:
            _load_module(module, reader, f"{prefix}{name}.", dtype, device, model._init_weights)

    streamer = LayerStreamer(reader, layer_prefix, dtype, device, model._init_weights)
    for index, layer in enumerate(decoder.layers):
        layer.register_forward_pre_hook(lambda module, _args, index=index: streamer.load(index, module))
        layer.register_forward_hook(lambda module, _args, _output: streamer.release(module))
    head_name = "lm_head.weight" if "lm_head.weight" in reader.entries else prefix + embed_name
    return StreamedModel(model, torch.searchsorted(used, input_ids), device, reader, head_name, used, streamer)


def streamed_perplexity(source, windows: torch.Tensor, *, cut=None, dtype: torch.dtype, device: torch.device,
                        batch_size: int = 1) -> float:
    """`perplexity()` of the model under `cut`, without holding it (StreamedModel.perplexity)."""
    streamed = build_streamed(source, windows, dtype=dtype, device=device)
    return streamed.perplexity(windows, cut=cut, batch_size=batch_size)
