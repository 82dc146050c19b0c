"""config.json after layer removal: layer count, per-layer lists, and fields that name layer indices.

Generic rules instead of per-family code (the per-family facts live in the tables below):
* every list whose length is the old layer count is per-layer data (`layer_types`, `mlp_layer_types`,
  `no_rope_layers`, ...): keep the survivors' entries, so each kept layer stays what it was;
* lists of layer *indices* (`mlp_only_layers`) are renumbered, thresholds ("layers below k are X":
  `max_window_layers`, `first_k_dense_replace`) become the count of kept layers below k;
* a structure decided by an index formula (`(i + 1) % decoder_sparse_step == 0`) cannot follow the
  survivors, so such configs are refused by name.
Per-layer lists that transformers *derives* when config.json lacks them (Gemma2's alternation,
Gemma3's `sliding_window_pattern`, Qwen2's `max_window_layers`) would be re-derived for the new layer
count and silently change the survivors' types, so they are written out explicitly.
"""

import copy

from prunetool.checkpoint_io import text_section
from prunetool.errors import UnsupportedModelError
from prunetool.sources.checks import read_config

# Lists that are never per-layer data, whatever their length happens to be.
NOT_PER_LAYER = {"architectures", "eos_token_id", "bos_token_id", "pad_token_id", "bad_words_ids",
                 "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids"}  # fmt: skip
# Lists of original layer indices: renumbered, never sliced (even when their length is the layer count).
INDEX_LISTS = ("mlp_only_layers", "moe_layers")
# "Layer i is special iff i < value": the new value counts the kept layers below the old one.
THRESHOLDS = ("max_window_layers", "first_k_dense_replace")
# Index formulas whose meaning survives only at the neutral value given here.
FORMULAS = {
    "decoder_sparse_step": 1,  # Qwen MoE: MoE iff (i + 1) % step == 0
    "moe_layer_freq": 1,  # DeepSeek: MoE iff i % freq == 0
    "interleave_moe_layer_step": 1,  # Llama 4: MoE every step-th layer
    "num_kv_shared_layers": 0,  # Gemma 3n: the last k layers reuse earlier layers' KV
}
# Pattern fields that derive layer types by index; harmless once `layer_types` is explicit.
PATTERNS = ("sliding_window_pattern", "_sliding_window_pattern")


def is_per_layer_list(name: str, value, num_layers: int) -> bool:
    """A list with one entry per layer (sliced by kept index), as opposed to token ids or layer indices."""
    if name in NOT_PER_LAYER or name in INDEX_LISTS:
        return False
    return isinstance(value, (list, tuple)) and len(value) == num_layers


def prune_config(config: dict, kept: list[int], derived: dict | None) -> dict:
    """A new config dict for a model that keeps the original layers `kept` (sorted, 0-based).

    `derived` maps per-layer list fields that transformers computes but config.json lacks (from
    `derived_layer_lists`) to their full-length values; they are sliced and written explicitly.
    Every other field is left untouched. The input is not modified.
    """
    config = copy.deepcopy(config)
    text = text_section(config)
    num_layers = text.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise UnsupportedModelError("config.json has no num_hidden_layers in its text config; cannot prune it")
    kept = sorted(kept)
    if not kept or kept[0] < 0 or kept[-1] >= num_layers:
        raise UnsupportedModelError(f"kept layers {kept} do not fit a {num_layers}-layer config")
    _refuse_formulas(text)
    for name, value in (derived or {}).items():
        if text.get(name) is None:
            text[name] = list(value)
    for name, value in list(text.items()):
        if isinstance(value, list) and is_per_layer_list(name, value, num_layers):
            text[name] = [value[i] for i in kept]
    _remap_indices(text, kept)
    text["num_hidden_layers"] = len(kept)
    if text.get("layer_types") is None:
        _refuse_patterns(text)
    return config


def _refuse_formulas(text: dict) -> None:
    for name, neutral in FORMULAS.items():
        value = text.get(name)
        if value is not None and value != neutral:
            raise UnsupportedModelError(
                f"config field {name}={value} places layers by an index formula that removing layers would break; "
                "pruning this architecture is not supported"
            )


def _remap_indices(text: dict, kept: list[int]) -> None:
    new_index = {old: new for new, old in enumerate(kept)}
    for name in THRESHOLDS:
        value = text.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            text[name] = sum(1 for i in kept if i < value)
    for name in INDEX_LISTS:
        value = text.get(name)
        if isinstance(value, list):
            if not all(isinstance(i, int) for i in value):
                raise UnsupportedModelError(f"config field {name} should list layer indices, found {value!r}")
            text[name] = [new_index[i] for i in value if i in new_index]


def _refuse_patterns(text: dict) -> None:
    for name in PATTERNS:
        value = text.get(name)
        if isinstance(value, int) and value > 1:
            raise UnsupportedModelError(
                f"config field {name}={value} decides layer types by index and transformers gives no "
                "layer_types list to write instead; pruning this architecture is not supported"
            )


def derived_layer_lists(source_dir, config: dict) -> tuple[int, dict]:
    """(layer count, per-layer lists transformers derives that config.json lacks), read via AutoConfig.

    The layer count comes from transformers too, so a config.json relying on a class default for
    num_hidden_layers still prunes correctly.
    """
    from transformers import AutoConfig

    from prunetool.sources.checks import ships_our_code

    try:
        loaded = AutoConfig.from_pretrained(source_dir, trust_remote_code=ships_our_code(source_dir))
        loaded = loaded.get_text_config(decoder=True)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise UnsupportedModelError(f"transformers cannot read {source_dir}/config.json: {e}") from e
    num_layers = loaded.num_hidden_layers
    on_disk = text_section(config)
    derived = {
        name: list(value)
        for name, value in loaded.to_dict().items()
        if on_disk.get(name) is None and is_per_layer_list(name, value, num_layers)
    }
    return num_layers, derived


def load_config(source_dir) -> tuple[dict, int, dict]:
    """(config.json as a dict, decoder layer count, derived per-layer lists) for `prune_config`."""
    config = read_config(source_dir)
    num_layers, derived = derived_layer_lists(source_dir, config)
    text_section(config).setdefault("num_hidden_layers", num_layers)
    return config, num_layers, derived
