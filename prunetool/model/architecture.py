"""Where each architecture keeps its decoder layers and query projection.

Described as data plus one structural rule, not per-family code: a decoder layer's attention module
must own `q_proj` (query heads x head_dim outputs) or a fused `qkv_proj` whose first H*D outputs are
the query (Phi-3). Families listed in TESTED are covered by the test suite on tiny random configs;
other families that fit the rule are scored with a warning, anything else is refused by name.
"""

from dataclasses import dataclass

from torch import nn

from prunetool.errors import UnsupportedModelError

TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3")

# attention-module attribute -> does the query share the projection with keys and values?
QUERY_PROJECTIONS = {"q_proj": False, "qkv_proj": True}
ATTENTION_ATTRIBUTES = ("self_attn", "attention", "attn")


@dataclass(frozen=True)
class DecoderLayout:
    """What the capture hooks need to find a layer's queries and its input/output."""

    model_type: str
    layers: nn.ModuleList
    attentions: tuple[nn.Module, ...]
    query_projections: tuple[nn.Linear, ...]
    num_heads: int
    head_dim: int
    tested: bool

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def query_width(self) -> int:
        return self.num_heads * self.head_dim


def describe(model: nn.Module) -> str:
    config = model.config
    return f"model_type '{config.model_type}' ({type(model).__name__})"


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (for multimodal Gemma 3, its language model)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise UnsupportedModelError(f"unsupported architecture: {describe(model)} has no decoder `layers` list")
    return decoder


def _attention_of(layer: nn.Module) -> nn.Module | None:
    for name in ATTENTION_ATTRIBUTES:
        module = getattr(layer, name, None)
        if module is not None:
            return module
    return None


def _query_projection(attention: nn.Module, width: int) -> nn.Linear | None:
    for name, fused in QUERY_PROJECTIONS.items():
        proj = getattr(attention, name, None)
        if isinstance(proj, nn.Linear) and (proj.out_features > width if fused else proj.out_features == width):
            return proj
    return None


def inspect_decoder(model: nn.Module) -> DecoderLayout:
    """Find every layer's attention and query projection, or refuse the model with a one-line reason."""
    decoder = decoder_of(model)
    text_config = model.config.get_text_config(decoder=True)
    num_heads = text_config.num_attention_heads
    first_attention = _attention_of(decoder.layers[0])
    head_dim = getattr(first_attention, "head_dim", None) or getattr(text_config, "head_dim", None)
    head_dim = head_dim or text_config.hidden_size // num_heads
    width = num_heads * head_dim
    attentions, projections = [], []
    for index, layer in enumerate(decoder.layers):
        attention = _attention_of(layer)
        projection = _query_projection(attention, width) if attention is not None else None
        if projection is None:
            raise UnsupportedModelError(
                f"unsupported architecture: {describe(model)}: layer {index} has no q_proj/qkv_proj query "
                f"projection with {num_heads} heads x {head_dim} dims; supported: {', '.join(TESTED)}"
            )
        attentions.append(attention)
        projections.append(projection)
    return DecoderLayout(
        model_type=model.config.model_type,
        layers=decoder.layers,
        attentions=tuple(attentions),
        query_projections=tuple(projections),
        num_heads=num_heads,
        head_dim=head_dim,
        tested=model.config.model_type in TESTED,
    )


def cache_argument(model) -> str:
    """transformers >= 5.24 names the forward's cache `cache` (`past_key_values` is deprecated); older 5.x and
    remote code (a nemotron-nas folder's) keep the old name."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
