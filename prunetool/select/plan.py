"""The plan between selection and surgery: which original layers go, chosen how, from which scores.

Selection produces a PrunePlan; checkpoint surgery consumes only the plan. Every index here is a
0-based index of the original model.
"""

from dataclasses import dataclass, field

from prunetool.cut import Cut
from prunetool.errors import OptionError


@dataclass(frozen=True)
class PrunePlan:
    base_model: str  # what the user named (alias, folder, hub id, .gguf)
    num_layers: int  # layers in the original model
    removed: tuple[int, ...]  # sorted, original 0-based indices
    criterion: str  # "qsim", "tappa", ..., or "manual" for --remove-layers
    parameters: dict = field(default_factory=dict)  # e.g. {"beta": 0.3, "protect_first": 0}
    criterion_values: list[float] | None = None  # the per-layer values the criterion ranked, if any
    calibration: dict | None = None  # CalibrationSet.describe() of the scores used, if any
    search_calibration: dict | None = None  # the windows a perplexity search measured (guided, ppl), if any
    unit: str = "block"  # what `removed` indexes: whole layers, or the attention or MLP sublayer of those layers
    cut: Cut | None = None  # the per-layer cut; given for mixed cuts (then `removed` and `unit` follow from it)
    targets: dict | None = None  # prune --target: each target, the base's and the cut's value, and whether met

    def __post_init__(self):
        if self.cut is not None:
            if self.cut.num_layers != self.num_layers:
                raise OptionError(f"the cut is for {self.cut.num_layers} layers, the plan for {self.num_layers}")
            object.__setattr__(self, "removed", tuple(sorted(set(self.cut.attention) | set(self.cut.mlp))))
            object.__setattr__(self, "unit", self.cut.kind)
        removed = tuple(sorted(self.removed))
        object.__setattr__(self, "removed", removed)
        if len(set(removed)) != len(removed):
            raise OptionError(f"layer indices must be distinct, got {list(self.removed)}")
        if not removed:
            raise OptionError("nothing to remove: the plan names no layers")
        if removed[0] < 0 or removed[-1] >= self.num_layers:
            raise OptionError(f"layer indices must be in 0..{self.num_layers - 1}, got {list(removed)}")
        if self.cut is None and len(removed) >= self.num_layers and self.unit != "mlp":
            what = "layers" if self.unit == "block" else "attention sublayers"
            raise OptionError(f"cannot remove all {self.num_layers} {what}; at least one must stay")
        if self.cut is None:
            object.__setattr__(self, "cut", Cut.of(self.unit, removed, self.num_layers))

    @property
    def kept(self) -> tuple[int, ...]:
        """The layers the written model has (a whole block leaves; a layer that loses a sublayer stays)."""
        return self.cut.kept

    @property
    def index_map(self) -> dict[int, int]:
        """Original index -> new index for every kept layer."""
        return {old: new for new, old in enumerate(self.kept)}

    def to_json(self) -> dict:
        return {
            "base_model": self.base_model,
            "num_layers": self.num_layers,
            "unit": self.unit,
            "removed": list(self.removed),
            "kept": list(self.kept),
            "index_map": {str(old): new for old, new in self.index_map.items()},
            "criterion": self.criterion,
            "parameters": self.parameters,
            "criterion_values": self.criterion_values,
            "calibration": self.calibration,
            "search_calibration": self.search_calibration,
            "cut": self.cut.to_json(),
            "targets": self.targets,
            "indexing": "0-based indices of the original model",
        }
