"""A Llama-family config.json -> the nemotron-nas (DeciLM) config.json of the same model with sublayers removed.

Pure functions of the source config (a dict, as read from config.json). Shapes are reproduced exactly or
the cut is refused: `n_heads_in_group` must divide the query heads, and `ffn_mult` is written only where
the format's rounding (int(2 * ffn_mult * hidden / 3), up to a multiple of 256) gives the source's MLP
width back; elsewhere the width is written as `intermediate_size`, which vLLM reads instead (llama.cpp's
own converter reads only ffn_mult; `prunetool export --gguf` writes such folders).

Every block writes every key the engines read, a no-op one with `"n_heads_in_group": null` or
`"ffn_mult": null`, since llama.cpp's converter indexes them on every block. Cuts an engine cannot run
are refused here, before anything is written (`check_engine_rules`).

The same cut is also recorded as transformers' `per_layer_config` skips ({"3": {"skip": ["attention"]}}),
which transformers parses but does not apply yet (the modeling side is still under review upstream).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prunetool.errors import OptionError, UnsupportedModelError

ARCHITECTURE = "DeciLMForCausalLM"
MODEL_TYPE = "nemotron-nas"
CODE_FILES = ("configuration_decilm.py", "modeling_decilm.py")
AUTO_MAP = {"AutoConfig": "configuration_decilm.DeciLMConfig",
            "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
# why the format cannot hold the others (until a format for them exists)
REFUSED = {
    "gemma": "Gemma's embedding scale and (1 + weight) norms",
    "gemma2": "Gemma 2's sandwich norms, logit soft-capping and sliding-window layers",
    "gemma3": "Gemma 3's sandwich norms, q/k norms and sliding-window layers",
    "gemma3_text": "Gemma 3's sandwich norms, q/k norms and sliding-window layers",
    "qwen3": "Qwen3's q_norm and k_norm inside attention",
    "phi3": "Phi-3's fused qkv_proj and gate_up_proj and partial rotary embedding",
}
SOURCE_ONLY = ("architectures", "model_type", "auto_map", "layer_types", "use_sliding_window", "sliding_window",
               "max_window_layers", "transformers_version")


def check_expressible(config: dict) -> None:
    """Refuse, in one line, a source the nemotron-nas format cannot describe exactly."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise UnsupportedModelError(f"--unit attention|mlp writes a nemotron-nas checkpoint, which cannot express "
                                    f"{REFUSED[model_type]}; prune whole blocks (--unit block) instead")
    if model_type not in LLAMA_FAMILY:
        raise UnsupportedModelError(f"--unit attention|mlp writes a nemotron-nas checkpoint, written for the Llama "
                                    f"family ({', '.join(LLAMA_FAMILY)}), not model_type {model_type!r}; prune whole "
                                    "blocks instead")
    windowed = config.get("use_sliding_window", model_type == "mistral") and config.get("sliding_window")
    if windowed or any(kind != "full_attention" for kind in config.get("layer_types") or []):
        raise UnsupportedModelError(f"{model_type} with sliding-window attention (sliding_window="
                                    f"{config.get('sliding_window')}) has no nemotron-nas form; prune whole blocks")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise UnsupportedModelError("nemotron-nas MLPs are bias-free SiLU-gated; this model's are not")


def ffn_mult_for(intermediate_size: int, hidden_size: int) -> float | None:
    """An ffn_mult that the format's rounding turns back into `intermediate_size` exactly, or None."""
    if intermediate_size % 256:
        return None
    guess = intermediate_size * 3 / (2 * hidden_size)
    for candidate in (round(guess, 6), guess, round(guess, 12)):
        width = int(2 * candidate * hidden_size / 3)
        width = width if width % 256 == 0 else width + 256 - width % 256
        if width == intermediate_size:
            return candidate
    return None


def check_removed(num_layers: int, removed_attention, removed_mlp) -> tuple[set[int], set[int]]:
    attention, mlp = set(removed_attention), set(removed_mlp)
    outside = sorted(index for index in attention | mlp if not 0 <= index < num_layers)
    if outside:
        raise OptionError(f"sublayer indices must be in 0..{num_layers - 1}, got {outside}")
    if len(attention) >= num_layers:
        raise OptionError(f"cannot remove all {num_layers} attention sublayers; at least one must stay")
    return attention, mlp


def check_engine_rules(num_layers: int, removed_attention, removed_mlp) -> None:
    """Refuse, in one line naming the engine, a sublayer cut that a serving engine computes wrongly or not at all
    (prunetool.cut.first_mlp_before_attention: vLLM's first-attention rule), for a folder where every layer stays."""
    from prunetool.cut import first_mlp_before_attention

    index = first_mlp_before_attention(num_layers, removed_attention, removed_mlp)
    if index is not None:
        raise OptionError(f"vLLM cannot serve this cut: layer {index} keeps its MLP but no attention runs before "
                          "it, which vLLM's nemotron_nas forward does not handle; keep that layer's attention "
                          "or remove its whole block")


def block_configs_for(config: dict, removed_attention=(), removed_mlp=()) -> list[dict]:
    """One block config per layer with every key written: the kept sublayers' shapes are the source's."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"{heads} query heads do not split into groups of {kv_heads} key/value heads")
    attention, mlp = check_removed(layers, removed_attention, removed_mlp)
    check_engine_rules(layers, attention, mlp)
    width, hidden = config["intermediate_size"], config["hidden_size"]
    multiplier = ffn_mult_for(width, hidden)
    ffn_shape = {"ffn_mult": multiplier} if multiplier is not None else {"intermediate_size": width}
    return [{"attention": {"no_op": index in attention, "replace_with_linear": False,
                           "n_heads_in_group": None if index in attention else heads // kv_heads},
             "ffn": {"no_op": index in mlp, "replace_with_linear": False}
             | ({"ffn_mult": None} if index in mlp else ffn_shape)}
            for index in range(layers)]


def per_layer_skips(removed_attention=(), removed_mlp=()) -> dict[str, dict]:
    """The cut as transformers' per_layer_config: {"layer index": {"skip": ["attention", "mlp"]}}."""
    skips: dict[str, dict] = {}
    for unit, removed in (("attention", removed_attention), ("mlp", removed_mlp)):
        for index in sorted(removed):
            skips.setdefault(str(index), {"skip": []})["skip"].append(unit)
    return skips


def nemotron_config(source_config: dict, removed_attention=(), removed_mlp=()) -> dict:
    """The config.json of the cut model in the nemotron-nas layout (every layer kept, some sublayers no-ops)."""
    check_expressible(source_config)
    config = {key: value for key, value in source_config.items() if key not in SOURCE_ONLY}
    if source_config["model_type"] == "qwen2":  # bias on q, k and v but not on o_proj
        config |= {"attention_bias": False, "qkv_bias": True}
    config |= {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "auto_map": dict(AUTO_MAP),
               "block_configs": block_configs_for(source_config, removed_attention, removed_mlp),
               "per_layer_config": per_layer_skips(removed_attention, removed_mlp)}
    return config


def write_code_files(folder: Path) -> None:
    """Copy our configuration and modeling code beside the weights (what trust_remote_code runs)."""
    here = Path(__file__).resolve().parent
    for name in CODE_FILES:
        shutil.copyfile(here / name, Path(folder) / name)

