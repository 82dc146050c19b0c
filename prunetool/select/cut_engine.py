"""Perplexity of candidate cuts from cached layer-boundary hidden states (the searches' measuring engine).

A greedy search (SLEB) measures, round after round, the current cut plus one more layer. A full forward
per candidate repeats the layers before that layer, which every candidate of the round shares. The engine
keeps the input of every layer for the current cut, for every measurement window, so a candidate that
also removes layer j runs only the kept layers after j, then the final norm and the head. Committing a
removal recomputes only the boundaries after it.

Exactness: each layer is called with the keyword arguments the decoder itself passed it (mask, position
embeddings, ...), captured once by pre-hooks on a plain forward. Removing layers in memory keeps every
survivor's own attention type (in_memory.config_edits), so a survivor sees the same arguments in any cut;
the tail is perplexity's own (decoder norm, then _head_nll_sum). A self-check at construction replays
the first window through every layer and refuses (EngineUnsupported) unless its NLL equals the capture
pass's own (which is perplexity()'s forward) to SELF_CHECK_RTOL.

Searches that only ask "does this candidate beat the one I hold?" pass give_up_above: the measurement
stops at the first window after which the candidate is certainly worse (NLL is never negative), and the
rest of its windows are never run.

Memory: (L + 1) x W x T x d activations in the model's dtype (SmolLM2-135M, 16 x 512 windows: 0.6 GB in
float32), plus one set of captured arguments per batch.

`model` is any ModelRunner (prunetool.model.runner) or a loaded model. A layer-streamed one (prune --low-memory)
loads its layers from the checkpoint when they are called, so the weights in memory are one layer's; its
head is read in vocabulary blocks once per measurement, over the final states of all its windows together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from prunetool.model.architecture import TESTED
from prunetool.model.perplexity import perplexity_from_mean
from prunetool.model.runner import ModelRunner, as_runner
from prunetool.model.sublayers import check_sublayer_layout, check_unit, sublayer_skipped
from prunetool.cut import BLOCK, KEPT, Cut

SELF_CHECK_RTOL = 1e-5


class EngineUnsupported(Exception):
    """The engine cannot reproduce this model's forward; callers fall back to full forwards."""


def _layer_output(output):
    return output[0] if isinstance(output, tuple) else output


class CutEngine:
    """Calibration perplexity of `current cut + extra layers`, reusing the shared prefix of every candidate."""

    def __init__(self, model, windows: torch.Tensor, *, batch_size: int = 1, self_check: bool = True,
                 unit: str = "block"):
        self.runner, self.unit = as_runner(model), check_unit(unit)
        if self.runner.config.model_type not in TESTED:
            raise EngineUnsupported(f"no layer-by-layer path for model type {self.runner.config.model_type!r}")
        self.model, self.batch_size = self.runner.model, max(1, batch_size)
        self.decoder = self.runner.decoder
        self.layers = list(self.runner.layers)
        if unit != "block":
            for layer in self.layers:
                check_sublayer_layout(layer, unit)
        self.device = self.runner.device  # the embedding's device
        inputs = self.runner.input_rows(windows)  # embedding rows
        self.batches = [inputs[start:start + self.batch_size].to(self.device, torch.long)
                        for start in range(0, windows.shape[0], self.batch_size)]
        self.targets = [windows[start:start + self.batch_size, 1:].reshape(-1).to(self.device, torch.long)
                        for start in range(0, windows.shape[0], self.batch_size)]
        self.cut = Cut(len(self.layers))  # the current cut, whose boundaries `states` holds
        self._layouts_checked: set[tuple[int, str]] = set()
        self.batches_skipped = 0  # batches perplexity_without(give_up_above=...) did not need to run
        self.kwargs: list[list[dict]] = []  # [batch][layer] -> the decoder's keyword arguments to that layer
        self.states: list[list[torch.Tensor]] = []  # [batch][boundary] -> input of layer `boundary` (L: output)
        plain_first = None  # the plain forward's NLL of the first batch: the capture pass is that forward
        for batch in self.batches:
            arguments, inputs, last_hidden = self._capture(batch)
            self.kwargs.append(arguments)
            self.states.append(inputs)
            if self_check and plain_first is None:
                with torch.inference_mode():
                    plain_first = self.runner.head_nll_sum(
                        last_hidden[:, :-1].reshape(-1, last_hidden.shape[-1]), self.targets[0])
        if self_check:
            self._check(plain_first)

    def _check(self, plain_first: float) -> None:
        """Refuse (EngineUnsupported) unless replaying the layers reproduces the model's own forward.

        The first batch is replayed through every layer from its embedding output with the captured
        arguments, then the decoder norm and the head, and compared with the capture pass's own output
        through the same head (that pass is perplexity()'s forward, so no second forward is run).
        """
        with torch.inference_mode():
            mine = self._nll(0, self._run(0, 0, self.cut))
        if not math.isclose(mine, plain_first, rel_tol=SELF_CHECK_RTOL):
            raise EngineUnsupported(f"layer-by-layer NLL {mine!r} differs from the model's {plain_first!r}")

    def _capture(self, batch: torch.Tensor) -> tuple[list[dict], list[torch.Tensor], torch.Tensor]:
        """One plain forward with a pre-hook on every layer: what each layer was given, the last layer's
        output, and the decoder's own output (after its norm)."""
        arguments: list[dict | None] = [None] * len(self.layers)
        inputs: list[torch.Tensor | None] = [None] * (len(self.layers) + 1)

        def hook_for(index: int):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                inputs[index] = hidden.detach()
                arguments[index] = {key: value for key, value in kwargs.items() if key != "hidden_states"}
            return hook

        def keep_output(module, args, kwargs, output):
            inputs[-1] = _layer_output(output).detach()

        handles = [layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        handles.append(self.layers[-1].register_forward_hook(keep_output, with_kwargs=True))
        try:
            with torch.inference_mode():
                output = self.decoder(input_ids=batch, use_cache=False).last_hidden_state
        finally:
            for handle in handles:
                handle.remove()
        return arguments, inputs, output

    @property
    def removed(self) -> tuple[int, ...]:
        """The current cut's layers of this engine's unit (what `remove` and `perplexity_without` count in)."""
        return self.cut.layers_of(self.unit)

    def _as_cut(self, layers: Iterable[int]) -> Cut:
        return Cut.of(self.unit, layers, len(self.layers))

    def _layer(self, batch: int, index: int, hidden: torch.Tensor, cut: Cut) -> torch.Tensor:
        """Layer `index` on `hidden`: skipped whole, run with a sublayer skipped, or run."""
        state = cut.state(index)
        if state == KEPT:
            return _layer_output(self.layers[index](hidden, **self.kwargs[batch][index]))
        if state == BLOCK:
            return hidden
        if (index, state) not in self._layouts_checked:
            check_sublayer_layout(self.layers[index], state)
            self._layouts_checked.add((index, state))
        with sublayer_skipped(self.layers[index], state):
            return _layer_output(self.layers[index](hidden, **self.kwargs[batch][index]))

    def _run(self, batch: int, start: int, cut: Cut) -> torch.Tensor:
        """The output of the last layer, starting from the cached input of layer `start`, under `cut`."""
        hidden = self.states[batch][start]
        for index in range(start, len(self.layers)):
            hidden = self._layer(batch, index, hidden, cut)
        return hidden

    def _first_change(self, cut: Cut) -> int:
        """The first layer whose state differs from the current cut's (L when none does)."""
        return next((index for index in range(len(self.layers)) if cut.state(index) != self.cut.state(index)),
                    len(self.layers))

    def _normed(self, last: torch.Tensor) -> torch.Tensor:
        hidden = self.runner.final_norm(last)[:, :-1]
        return hidden.reshape(-1, hidden.shape[-1])

    def _nll(self, batch: int, last: torch.Tensor) -> float:
        return self.runner.head_nll_sum(self._normed(last), self.targets[batch])

    def perplexity_without(self, extra: Iterable[int], batches: Sequence[int] | None = None, *,
                           give_up_above: float = math.inf) -> float:
        """Perplexity with the current cut and `extra` removed, over all batches or the given ones.

        `give_up_above`: a search that only needs to know whether this candidate beats a value it already
        holds stops measuring as soon as the answer is no. Every window's NLL is non-negative, so the
        windows measured so far give a lower bound exp(partial sum / all tokens); once that bound exceeds
        the limit the rest are skipped and the bound is returned. The result is therefore exact whenever
        it is <= give_up_above, and above the limit (never above the exact value) otherwise. A runner whose
        head is read from disk measures all windows in one head pass and is always exact.
        """
        extra = set(extra) - set(self.removed)
        if len(set(self.removed) | extra) >= len(self.layers) and self.unit in ("block", "attention"):
            return math.inf  # nothing left to run, or no attention left to read the context
        return self.perplexity_of(self.cut.plus(self.unit, extra), batches, give_up_above=give_up_above)

    def perplexity_of(self, cut: Cut, batches: Sequence[int] | None = None, *,
                      give_up_above: float = math.inf) -> float:
        """Perplexity under any cut (blocks and sublayers mixed), reusing the current cut's boundaries up to the
        first layer whose state differs; `give_up_above` as in perplexity_without."""
        start = self._first_change(cut)
        chosen = range(len(self.batches)) if batches is None else batches
        with torch.inference_mode():
            if self.runner.head_from_disk:  # one pass of the head over every window's final states
                hidden = torch.cat([self._normed(self._run(batch, start, cut)) for batch in chosen])
                total = self.runner.head_nll_sum(hidden, torch.cat([self.targets[batch] for batch in chosen]))
                return perplexity_from_mean(total / hidden.shape[0])
            tokens = sum(self.targets[batch].numel() for batch in chosen)
            total = 0.0
            for done, batch in enumerate(chosen, start=1):
                total += self._nll(batch, self._run(batch, start, cut))
                if perplexity_from_mean(total / tokens) > give_up_above:
                    self.batches_skipped += len(chosen) - done
                    break
        return perplexity_from_mean(total / tokens)

    def remove(self, layers: Iterable[int]) -> None:
        """Commit `layers` to the current cut and recompute the boundaries after the first of them."""
        self.set_cut(set(self.removed) | set(layers))

    def set_cut(self, layers: Iterable[int] | Cut) -> None:
        """Make `layers` (of this engine's unit, or a Cut) the current cut: boundaries up to the first changed
        layer are kept."""
        wanted = layers if isinstance(layers, Cut) else self._as_cut(set(layers))
        first = self._first_change(wanted)
        if first == len(self.layers):
            return
        self.cut = wanted
        with torch.inference_mode():
            for batch, states in enumerate(self.states):
                hidden = states[first]
                for index in range(first, len(self.layers)):
                    hidden = self._layer(batch, index, hidden, wanted).detach()
                    states[index + 1] = hidden

    def layer_forwards(self, extra: Iterable[int]) -> int:
        """Layers one batch runs for this candidate (the cost a full forward would pay is L - |cut|)."""
        extra = set(extra) - set(self.removed)
        if not extra:
            return 0
        skip = set(self.removed) | extra
        return sum(1 for index in range(min(extra), len(self.layers)) if index not in skip or self.unit != "block")


def screening_model(model):
    """The model a cheap screening pass runs: a bfloat16 copy of a float32 model where bfloat16 is native
    (screening 128-token windows of SmolLM2 is about 3x faster so, on an AVX512-BF16 CPU), else the model
    (ModelRunner.screening_copy). A plain nn.Module comes back as one, a runner as a runner.

    Screening only ranks candidates for the float32 measurements that decide (halving's confirmations),
    so its lower precision changes which candidates are confirmed at most among near-ties. A layer-streamed
    model (prune --low-memory) gets a second streamed skeleton whose layers load in bfloat16, the same
    rounding of the same checkpoint.
    """
    screened = as_runner(model).screening_copy()
    return screened if isinstance(model, ModelRunner) else screened.model
