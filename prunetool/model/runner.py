"""The model-runner contract: what perplexity, the cut engine and the patch fit need from "something that
runs decoder layers", whether its weights are all in memory or streamed from disk one layer at a time.

Callers take a `ModelRunner` (or a plain transformers model, which `as_runner` wraps) and never ask which
kind they hold: they ask what it can do. A loaded model (`LoadedModel`) keeps every weight in memory; the
layer-streamed executor (prunetool.model.streaming.StreamedModel, prune --low-memory) loads each layer when it
runs and reads its head from the checkpoint in vocabulary blocks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from prunetool.model.architecture import decoder_of
from prunetool.model.in_memory import layers_removed
from prunetool.model.sublayers import sublayers_removed
from prunetool.model.loading import input_device
from prunetool.model import perplexity as windowed  # by module: tests and benches patch its budget


SCREEN_DTYPE = torch.bfloat16  # what halving's screening runs in where that is native (screening_copy)
SCREEN_COPY_ROOM = 2.0  # the low-precision copy is made only where twice its size is still free


class ModelRunner:
    """A decoder stack with an embedding, layers, a final norm and an LM head, run on `device` in `dtype`.

    Capabilities callers branch on (instead of on the type):
    * `holds_embedding_table`: False where the embedding holds only the calibration rows, so a patch cannot
      fold into it;
    * `head_from_disk`: the head is read from the checkpoint per measurement, so measure all windows' final
      states in one head pass rather than batch by batch.
    """

    model: nn.Module
    holds_embedding_table = True
    head_from_disk = False

    @property
    def config(self):
        return self.model.config

    @property
    def decoder(self) -> nn.Module:
        return decoder_of(self.model)

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    device: torch.device  # where inputs go: the embedding's device

    def input_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the embedding rows to feed (the ids themselves unless the table was cut down)."""
        return ids

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(hidden)

    def head_nll_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> float:
        """Summed NLL of `targets` (N,) under the LM head applied to normed `hidden` (N, d)."""
        return windowed._head_nll_sum(self.model, hidden, targets)

    def perplexity(self, windows: torch.Tensor, *, cut=None, batch_size: int = 1) -> float:
        """model.perplexity.perplexity() of the model under `cut` (a prunetool.cut.Cut; None: the whole model)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def layer_loaded(self, index: int):
        """Layer `index` holds its real weights inside the block (for code that reads them, like the patch fit)."""
        yield self.layers[index]

    def replace_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Decoder-relative tensors (e.g. `layers.5.mlp.down_proj.weight`) used from now on instead of the
        model's own, cast to the model's dtype as a reload of a written checkpoint would hold them."""
        raise NotImplementedError

    def tensors_replaced(self, tensors: dict[str, torch.Tensor]):
        """replace_tensors for the duration of a `with` block only."""
        raise NotImplementedError

    def screening_copy(self) -> ModelRunner:
        """The runner a cheap screening pass uses (cut_engine.screening_model); by default this one."""
        return self


class LoadedModel(ModelRunner):
    """A transformers model with every weight in memory (possibly spread over devices)."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def device(self) -> torch.device:
        return input_device(self.model)

    def perplexity(self, windows: torch.Tensor, *, cut=None, batch_size: int = 1) -> float:
        with removed_units(self.model, cut):
            return windowed.perplexity(self.model, windows, batch_size=batch_size)

    def replace_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in tensors.items():
                parameter = self.decoder.get_parameter(name)
                parameter.copy_(value.to(parameter.dtype))

    @contextlib.contextmanager
    def tensors_replaced(self, tensors: dict[str, torch.Tensor]):
        """Copies the new values into the parameters and restores the old ones afterwards."""
        decoder, saved = self.decoder, {}
        try:
            with torch.no_grad():
                for name, value in tensors.items():
                    parameter = decoder.get_parameter(name)
                    saved[name] = parameter.detach().clone()
                    parameter.copy_(value.to(parameter.dtype))
            yield
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    decoder.get_parameter(name).copy_(value)

    def screening_copy(self) -> ModelRunner:
        copy = bfloat16_copy(self.model)
        return self if copy is self.model else LoadedModel(copy)


def native_bfloat16(device: torch.device) -> bool:
    """bfloat16 matmuls run natively on `device`: a CUDA GPU that supports them, or a CPU whose oneDNN has
    bfloat16 kernels (AVX512-BF16 or AMX). Elsewhere they are emulated and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def bfloat16_copy(model: nn.Module) -> nn.Module:
    """A bfloat16 copy of a float32 model where bfloat16 is native, else the model itself.

    The copy keeps the model's buffers (RoPE frequencies stay float32, as when a checkpoint is loaded in
    bfloat16) and its tied weights tied. Not made for a device-mapped model, for a model already in a
    16-bit dtype, or where memory_available_bytes() leaves less than SCREEN_COPY_ROOM times its size.
    """
    import copy

    from prunetool.memory import memory_available_bytes

    if getattr(model, "hf_device_map", None):
        return model
    parameters, device = list(model.parameters()), input_device(model)
    if not parameters or any(p.dtype != torch.float32 for p in parameters) or not native_bfloat16(device):
        return model
    size = sum(p.numel() for p in parameters) * torch.finfo(SCREEN_DTYPE).bits // 8
    room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else memory_available_bytes()
    if room is not None and room < SCREEN_COPY_ROOM * size:
        return model
    memo = {id(p): torch.nn.Parameter(p.detach().to(SCREEN_DTYPE), requires_grad=False) for p in parameters}
    low = copy.deepcopy(model, memo)  # parameters come from the memo: no float32 duplicate is ever made
    return low.eval()


@contextlib.contextmanager
def removed_units(model: nn.Module, cut):
    """The context that makes a Cut in memory (None: nothing). Sublayers are skipped first, by original index,
    then the whole blocks leave."""
    from prunetool.cut import ATTENTION, BLOCK, MLP, Cut

    cut = cut if cut is not None else Cut(len(decoder_of(model).layers))
    with contextlib.ExitStack() as stack:
        for state in (ATTENTION, MLP):
            if cut.layers_of(state):
                stack.enter_context(sublayers_removed(model, cut.layers_of(state), state))
        if cut.layers_of(BLOCK):
            stack.enter_context(layers_removed(model, cut.layers_of(BLOCK)))
        yield cut


def as_runner(model) -> ModelRunner:
    """The runner for `model`: itself when it already is one, else a LoadedModel around the nn.Module."""
    return model if isinstance(model, ModelRunner) else LoadedModel(model)


def cut_perplexity(model, windows: torch.Tensor, cut=None, *, batch_size: int = 1) -> float:
    """perplexity() under `cut` (a prunetool.cut.Cut; None: the whole model), for a loaded model or any ModelRunner."""
    return as_runner(model).perplexity(windows, cut=cut, batch_size=batch_size)
