"""What a prune removes, as one value: per layer, nothing, its attention, its MLP, or both (the whole block).

A Cut flows from selection through measurement to the writers and prune.json. It carries its own checks
(indices, at least one attention kept, the serving engines' rules) and answers the questions the code used
to ask of a `unit` string: which layers disappear, what the written folder looks like, how to say it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prunetool.errors import OptionError

UNITS = ("block", "attention", "mlp")
# per-layer states, in prune.json's per-layer mask
KEPT, ATTENTION, MLP, BLOCK = "kept", "attention", "mlp", "block"
STATES = (KEPT, ATTENTION, MLP, BLOCK)


def _indices(values: Iterable[int], num_layers: int, what: str) -> tuple[int, ...]:
    values = tuple(values)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in values) or len(set(values)) != len(values):
        raise OptionError(f"{what} indices must be distinct integers, got {list(values)}")
    outside = sorted(i for i in values if not 0 <= i < num_layers)
    if outside:
        raise OptionError(f"{what} indices must be in 0..{num_layers - 1} (0-based), got {outside}")
    return tuple(sorted(values))


def first_mlp_before_attention(num_layers: int, removed_attention, removed_mlp) -> int | None:
    """The first layer that would run its MLP before any attention has run, or None.

    vLLM's nemotron_nas forward (vllm/model_executor/models/nemotron_nas.py) starts its residual stream at the
    first attention it runs: a layer that runs its MLP earlier unpacks (hidden, residual) from an RMSNorm that
    returns one tensor while the residual is None, and fails.
    """
    attention, mlp = set(removed_attention), set(removed_mlp)
    for index in range(num_layers):
        if index not in attention:
            return None
        if index not in mlp:
            return index
    return None


def spans(layers: Iterable[int]) -> str:
    """(13, 14, 15, 18) -> '13-15, 18'."""
    runs: list[list[int]] = []
    for index in sorted(layers):
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


@dataclass(frozen=True)
class Cut:
    """The sublayers removed from a `num_layers`-layer model; a layer in both sets loses its whole block."""

    num_layers: int
    attention: tuple[int, ...] = ()  # layers whose attention goes (whole blocks included)
    mlp: tuple[int, ...] = ()  # layers whose MLP goes (whole blocks included)

    def __post_init__(self):
        object.__setattr__(self, "attention", _indices(self.attention, self.num_layers, "attention"))
        object.__setattr__(self, "mlp", _indices(self.mlp, self.num_layers, "MLP"))
        if len(self.attention) >= self.num_layers:
            what = "layers" if len(self.blocks) == self.num_layers else "attention sublayers"
            raise OptionError(f"cannot remove all {self.num_layers} {what}; at least one attention must stay")

    # ---------------------------------------------------------------- making one

    @classmethod
    def of(cls, unit: str, layers: Iterable[int], num_layers: int) -> Cut:
        """The cut that removes `unit` (block, attention or mlp) from each of `layers`."""
        if unit not in UNITS:
            raise OptionError(f"--unit must be one of {', '.join(UNITS)}, got {unit!r}")
        layers = tuple(layers)
        return cls(num_layers, layers if unit != MLP else (), layers if unit != ATTENTION else ())

    @classmethod
    def from_states(cls, states: Iterable[str]) -> Cut:
        """From a per-layer mask such as prune.json's ["kept", "attention", "block", ...]."""
        states = list(states)
        unknown = sorted({state for state in states if state not in STATES})
        if unknown:
            raise OptionError(f"unknown layer states {unknown}; each is one of {', '.join(STATES)}")
        return cls(len(states), [i for i, s in enumerate(states) if s in (ATTENTION, BLOCK)],
                   [i for i, s in enumerate(states) if s in (MLP, BLOCK)])

    def plus(self, unit: str, layers: Iterable[int]) -> Cut:
        """This cut with `unit` also removed from `layers`."""
        more = Cut.of(unit, layers, self.num_layers)
        return Cut(self.num_layers, set(self.attention) | set(more.attention), set(self.mlp) | set(more.mlp))

    # ---------------------------------------------------------------- what it removes

    @property
    def blocks(self) -> tuple[int, ...]:
        """Layers that lose both sublayers: they leave the written model."""
        return tuple(sorted(set(self.attention) & set(self.mlp)))

    @property
    def attention_only(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.attention) - set(self.mlp)))

    @property
    def mlp_only(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.mlp) - set(self.attention)))

    def state(self, layer: int) -> str:
        attention, mlp = layer in self.attention, layer in self.mlp
        return BLOCK if attention and mlp else ATTENTION if attention else MLP if mlp else KEPT

    @property
    def states(self) -> list[str]:
        return [self.state(layer) for layer in range(self.num_layers)]

    @property
    def empty(self) -> bool:
        return not self.attention and not self.mlp

    @property
    def blocks_only(self) -> bool:
        """True when every removal is a whole block: the cut is written as the source's own format."""
        return set(self.attention) == set(self.mlp)

    @property
    def kind(self) -> str:
        """block, attention or mlp when every removal is of one kind, else mixed (none for an empty cut)."""
        if self.empty:
            return "none"
        if self.blocks_only:
            return BLOCK
        if not self.mlp:
            return ATTENTION
        if not self.attention:
            return MLP
        return "mixed"

    def layers_of(self, unit: str) -> tuple[int, ...]:
        """The layers removed as `unit`: whole blocks, attention only, or MLP only."""
        return {BLOCK: self.blocks, ATTENTION: self.attention_only, MLP: self.mlp_only}[unit]

    @property
    def size(self) -> int:
        """Sublayers removed (a block counts two)."""
        return len(self.attention) + len(self.mlp)

    # ---------------------------------------------------------------- the written model

    @property
    def kept(self) -> tuple[int, ...]:
        """Original indices of the layers the written model has (a whole block leaves; a sublayer cut keeps its layer)."""
        gone = set(self.blocks)
        return tuple(index for index in range(self.num_layers) if index not in gone)

    @property
    def index_map(self) -> dict[int, int]:
        """Original index -> written index for every kept layer."""
        return {old: new for new, old in enumerate(self.kept)}

    def after_blocks(self) -> Cut:
        """The sublayer part of this cut, indexed in the model without its removed blocks."""
        renumber = self.index_map
        return Cut(len(self.kept), [renumber[i] for i in self.attention_only], [renumber[i] for i in self.mlp_only])

    def check_engines(self) -> None:
        """Refuse, in one line naming the engine, a cut a serving engine cannot run in the format it is written in.

        Whole blocks leave the model, so a cut of whole blocks only is written in the source's own format. Among
        the layers that stay in a nemotron-nas folder, vLLM's forward needs an attention to have run before any
        MLP (first_mlp_before_attention).
        """
        if self.blocks_only:
            return
        rest = self.after_blocks()
        layer = first_mlp_before_attention(rest.num_layers, rest.attention, rest.mlp)
        if layer is not None:
            original = self.kept[layer]
            where = f"layer {original}" + (f" (layer {layer} once the removed blocks are gone)" if layer != original
                                           else "")
            raise OptionError(f"vLLM cannot serve this cut: {where} keeps its MLP but no attention runs before it, "
                              "which vLLM's nemotron_nas forward does not handle; keep that layer's attention or "
                              "remove its whole block")

    # ---------------------------------------------------------------- words and records

    def describe(self) -> str:
        """'blocks 16-18, attention 13-15' (original 0-based indices)."""
        parts = [f"{label} {spans(layers)}" for label, layers in
                 (("blocks", self.blocks), ("attention", self.attention_only), ("MLP", self.mlp_only)) if layers]
        return ", ".join(parts) or "nothing"

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "layers": self.states, "blocks": list(self.blocks),
                "attention": list(self.attention_only), "mlp": list(self.mlp_only), "kind": self.kind,
                "describe": self.describe()}

    @classmethod
    def from_json(cls, data: dict) -> Cut:
        return cls.from_states(data["layers"])
