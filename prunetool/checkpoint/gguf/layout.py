"""Which llama.cpp architecture a folder becomes, and the hyperparameters llama.cpp reads for it.

Decided from the config and the tensor headers, before any tensor is read, so every refusal comes first.
Each supported family maps onto a llama.cpp graph that computes what transformers computes:

* llama, mistral (no sliding window)     -> `llama`
* qwen2                                  -> `qwen2`, or `llama` where llama.cpp's qwen2 graph cannot hold
                                            the head size (it assumes heads * head_dim == hidden size)
* qwen3                                  -> `qwen3`
* gemma3 text and the multimodal wrapper -> `gemma3` (text only), with the per-layer sliding-window
                                            pattern written out, since removed layers break the 5:1 rhythm
* nemotron-nas (sublayer cuts)           -> `deci`, with per-layer head counts and MLP widths

RoPE: the base frequency (and Gemma 3's local one for sliding layers), linear scaling as llama.cpp's keys,
llama3 scaling as the per-frequency divisors of a `rope_freqs` tensor; other scalings are refused. Gemma 3's
query scale is query_pre_attn_scalar**-0.5 in transformers but derived from the layer count in llama.cpp;
where they differ, the ratio is folded into q_norm.

llama.cpp's deci graph skips the rest of a layer whose MLP width is 0 (src/models/deci.cpp:
`if (n_ff == 0) continue;` comes before `inpL = cur`), which drops that layer's attention output. So a layer
with neither sublayer is left out (it is the identity), and a layer that keeps attention but lost its MLP
gets a zero-valued MLP of ZERO_FFN_WIDTH, which adds exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from prunetool.errors import UnsupportedModelError

# The narrowest MLP every --type stores as asked: one q8_0 block (32 values) per row of ffn_down.
ZERO_FFN_WIDTH = 32
REFUSED = {  # families llama.cpp runs that export does not write yet, and what they need
    "gemma": "Gemma 1 is not supported yet (it needs its GeGLU MLP and (1 + w) norms written)",
    "gemma2": "Gemma 2 is not supported yet (it needs attention logit soft-capping and its alternating "
              "sliding-window layers written)",
    "phi3": "Phi-3 is not supported yet (it needs its fused qkv_proj and gate_up_proj and its partial rotary "
            "embedding written)",
}
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "nemotron-nas")
SUPPORTED_NAMES = ("Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text, or the language model of the multimodal wrapper), "
                   "nemotron-nas")


@dataclass(frozen=True)
class Block:
    """One GGUF block: the folder's layer it comes from and the shapes llama.cpp must expect."""

    source: int  # the layer's index in the folder
    heads: int  # query heads; 0 where the attention was removed
    kv_heads: int
    ffn: int  # MLP width (ZERO_FFN_WIDTH where a zero MLP stands in)
    zero_ffn: bool = False


@dataclass(frozen=True)
class Layout:
    """Everything export decides before reading a tensor."""

    arch: gguf.MODEL_ARCH
    blocks: tuple[Block, ...]
    head_dim: int
    permute_qk: bool  # HF's rotate-half q/k rows -> GGML's interleaved RoPE (llama, deci)
    norm_shift: float  # Gemma's RMSNorm scales by (1 + w): stored as w + 1
    q_norm_scale: float  # a query scale llama.cpp does not apply, folded into q_norm (Gemma 3)
    rope_factors: tuple[float, ...] | None  # llama3-style RoPE: per-frequency divisors (rope_freqs.weight)
    hparams: tuple[tuple[str, object], ...]  # (GGUFWriter method, value), in writing order
    notes: tuple[str, ...]  # what export changed, shown to the user and written into the file
    dropped: tuple[int, ...] = ()  # folder layers left out (identity layers of a sublayer cut)

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    @property
    def zero_ffn_layers(self) -> tuple[int, ...]:
        return tuple(block.source for block in self.blocks if block.zero_ffn)


def check_model_type(model_type: str | None) -> None:
    """Refuse, from config.json alone, a family export does not write."""
    if model_type in REFUSED:
        raise UnsupportedModelError(f"cannot export {model_type} to GGUF: {REFUSED[model_type]}; export supports "
                                    f"{SUPPORTED_NAMES}")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(f"cannot export model_type {model_type!r} to GGUF; export supports "
                                    f"{SUPPORTED_NAMES}")


def plan_layout(config, shapes: dict[str, tuple[int, ...]], wrapped: bool = False) -> Layout:
    """The layout for a decoder config (and its tensor shapes), or a one-line refusal naming what is missing.

    `wrapped`: the decoder is a multimodal wrapper's language model (config under text_config).
    """
    model_type = config.model_type
    check_model_type(model_type)
    if model_type == "nemotron-nas":
        return deci_layout(config, shapes)
    if model_type == "gemma3_text":
        return gemma3_layout(config, wrapped)
    planner = {"llama": llama_layout, "mistral": llama_layout, "qwen2": qwen2_layout, "qwen3": qwen3_layout}[model_type]
    return planner(config)


# --------------------------------------------------------------------------------------------------
# Shared pieces


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def uniform_blocks(config) -> tuple[Block, ...]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return tuple(Block(index, heads, kv_heads, config.intermediate_size) for index in range(config.num_hidden_layers))


def check_full_attention(config) -> None:
    """llama.cpp's llama, qwen2, qwen3 and deci graphs have no sliding window: refuse a windowed layer."""
    kinds = getattr(config, "layer_types", None) or []
    windowed = [index for index, kind in enumerate(kinds) if kind != "full_attention"]
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", config.model_type == "mistral")
    if windowed or (uses_window and window and window < config.max_position_embeddings):
        raise UnsupportedModelError(f"{config.model_type} with sliding-window attention (sliding_window={window}) "
                                    "cannot be exported: llama.cpp's graph for it attends over the full context")


def check_activation(config, expected: str) -> None:
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if activation != expected:
        raise UnsupportedModelError(f"{config.model_type} with hidden activation {activation!r} cannot be exported: "
                                    f"llama.cpp's graph uses {expected}")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    if "rope_theta" not in params:
        params = {**params, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params


def rope_hparams(params: dict, what: str) -> list[tuple[str, object]]:
    """freq_base plus linear scaling; llama3 scaling is a tensor (llama3_rope_factors); others are refused."""
    kind = params.get("rope_type", "default") or "default"
    calls: list[tuple[str, object]] = [("add_rope_freq_base", float(params["rope_theta"]))]
    if kind == "linear":
        calls += [("add_rope_scaling_type", gguf.RopeScalingType.LINEAR),
                  ("add_rope_scaling_factor", float(params["factor"]))]
    elif kind not in ("default", "llama3"):
        raise UnsupportedModelError(f"{what} uses RoPE scaling {kind!r}, which export does not write; supported: "
                                    "default, linear, llama3")
    return calls


def llama3_rope_factors(config, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp divides each RoPE frequency by rope_freqs[i]: transformers' default frequencies over its llama3
    ones, both as transformers computes them (float32), so unscaled and fully scaled ones give exactly 1 and factor."""
    params = rope_parameters(config)
    if params.get("rope_type") != "llama3":
        return None
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    default = 1.0 / (float(params["rope_theta"]) ** exponents)
    return tuple(float(value) for value in (default.double() / scaled.double()))


def per_layer(values: list[int]) -> int | list[int]:
    """A scalar where every layer agrees (what llama.cpp's converter writes for block cuts), else the array."""
    return values[0] if len(set(values)) == 1 else values


def size_hparams(config, blocks: tuple[Block, ...], head_dim: int, arrays: bool = False) -> list[tuple[str, object]]:
    """Sizes llama.cpp reads for every architecture; per-layer ones as arrays where layers differ (or `arrays`)."""
    shape = (lambda values: values) if arrays else per_layer
    return [
        ("add_context_length", int(config.max_position_embeddings)),
        ("add_embedding_length", int(config.hidden_size)),
        ("add_block_count", len(blocks)),
        ("add_feed_forward_length", shape([block.ffn for block in blocks])),
        ("add_head_count", shape([block.heads for block in blocks])),
        ("add_head_count_kv", shape([block.kv_heads for block in blocks])),
        ("add_layer_norm_rms_eps", float(config.rms_norm_eps)),
        ("add_key_length", head_dim),
        ("add_value_length", head_dim),
        ("add_rope_dimension_count", head_dim),
        ("add_vocab_size", int(config.vocab_size)),
    ]


def layout(arch, config, blocks, *, permute_qk=False, norm_shift=0.0, q_norm_scale=1.0, extra=(), notes=(),
           dropped=(), arrays=False) -> Layout:
    head_dim = head_dim_of(config)
    hparams = size_hparams(config, blocks, head_dim, arrays) + list(extra)
    factors = llama3_rope_factors(config, head_dim)
    if factors is not None and arch not in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.DECI):
        raise UnsupportedModelError(f"{config.model_type} with llama3 RoPE scaling cannot be exported: llama.cpp reads "
                                    "rope_freqs only in its llama and deci graphs")
    return Layout(arch, tuple(blocks), head_dim, permute_qk, norm_shift, q_norm_scale, factors, tuple(hparams),
                  tuple(notes), tuple(dropped))


# --------------------------------------------------------------------------------------------------
# Families


def llama_layout(config, notes=()) -> Layout:
    """Llama, Mistral without a window, SmolLM2: llama.cpp's llama graph with interleaved RoPE."""
    check_full_attention(config)
    check_activation(config, "silu")
    return layout(gguf.MODEL_ARCH.LLAMA, config, uniform_blocks(config), permute_qk=True,
                  extra=rope_hparams(rope_parameters(config), config.model_type), notes=notes)


def qwen2_layout(config) -> Layout:
    """qwen2 where its graph fits; llama (with q/k/v biases and the q/k permutation) where it does not.

    llama.cpp's qwen2 graph sizes q_proj and o_proj as hidden x hidden, so a head_dim with
    heads * head_dim != hidden_size does not load there; the llama graph computes the same model.
    """
    check_full_attention(config)
    check_activation(config, "silu")
    if config.num_attention_heads * head_dim_of(config) != config.hidden_size:
        note = (f"written as llama.cpp's llama architecture: its qwen2 graph needs heads * head_dim == hidden_size "
                f"({config.num_attention_heads} * {head_dim_of(config)} != {config.hidden_size})")
        return llama_layout(config, notes=(note,))
    return layout(gguf.MODEL_ARCH.QWEN2, config, uniform_blocks(config),
                  extra=rope_hparams(rope_parameters(config), "qwen2"))


def qwen3_layout(config) -> Layout:
    check_full_attention(config)
    check_activation(config, "silu")
    return layout(gguf.MODEL_ARCH.QWEN3, config, uniform_blocks(config),
                  extra=rope_hparams(rope_parameters(config), "qwen3"))


def gemma3_query_scale(config, num_blocks: int) -> float:
    """transformers' query scale over llama.cpp's: the factor to fold into q_norm (1.0 when they agree).

    transformers scales queries by query_pre_attn_scalar**-0.5; llama.cpp's gemma3 graph uses
    1/sqrt(hidden_size / heads) for a 62-layer model (Gemma 3 27B) and 1/sqrt(head_dim) otherwise.
    """
    wanted = config.query_pre_attn_scalar ** -0.5
    per_head = config.hidden_size / config.num_attention_heads if num_blocks == 62 else head_dim_of(config)
    factor = wanted / per_head ** -0.5
    return 1.0 if math.isclose(factor, 1.0, rel_tol=1e-9) else factor


def gemma3_layout(config, wrapped: bool = False) -> Layout:
    """Gemma 3 text decoder: sliding-window pattern per layer, a local RoPE base for the sliding layers.

    Final logit soft-capping is written only for Gemma3ForCausalLM: the multimodal wrapper's forward
    applies none, whatever its text config says.
    """
    check_activation(config, "gelu_pytorch_tanh")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("Gemma 3 with attention logit soft-capping cannot be exported: llama.cpp's gemma3 "
                                    "graph has none")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention (an embedding model) cannot be exported as a "
                                    "causal GGUF")
    blocks = uniform_blocks(config)
    kinds = list(config.layer_types)
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {unknown} have no llama.cpp form")
    sliding = rope_parameters(config, "sliding_attention")
    if (sliding.get("rope_type") or "default") != "default":
        raise UnsupportedModelError(f"Gemma 3 sliding layers with RoPE scaling {sliding['rope_type']!r} cannot be "
                                    "exported: llama.cpp scales only the full-attention layers")
    extra = rope_hparams(rope_parameters(config, "full_attention"), "Gemma 3's full-attention layers")
    extra += [("add_rope_freq_base_swa", float(sliding["rope_theta"])),
              ("add_sliding_window", int(config.sliding_window)),
              ("add_sliding_window_pattern", [kind == "sliding_attention" for kind in kinds])]
    if getattr(config, "final_logit_softcapping", None) and not wrapped:
        extra.append(("add_final_logit_softcapping", float(config.final_logit_softcapping)))
    scale = gemma3_query_scale(config, len(blocks))
    notes = () if scale == 1.0 else (f"query scale query_pre_attn_scalar**-0.5 folded into q_norm (x{scale:.6g}): "
                                     "llama.cpp's gemma3 graph derives its own from the layer count",)
    return layout(gguf.MODEL_ARCH.GEMMA3, config, blocks, norm_shift=1.0, q_norm_scale=scale, extra=extra,
                  notes=notes)


def deci_blocks(config, shapes: dict[str, tuple[int, ...]]) -> tuple[list[Block], list[int]]:
    """Per-layer shapes of a nemotron-nas folder, identity layers left out, MLP-less layers given a zero MLP.

    Widths and key/value heads are read from the tensors (what transformers loaded and llama.cpp will
    load); the block configs say which sublayers exist.
    """
    blocks, dropped = [], []
    heads, head_dim = config.num_attention_heads, head_dim_of(config)
    for index, block in enumerate(config.block_configs):
        attention, ffn = block.attention, block.ffn
        if getattr(attention, "replace_with_linear", False) or getattr(ffn, "replace_with_linear", False):
            raise UnsupportedModelError(f"nemotron-nas layer {index} replaces a sublayer with a linear map, which "
                                        "prunetool's modeling code does not compute; export refuses it")
        has_attention, has_ffn = not attention.no_op, not ffn.no_op
        if not has_attention and not has_ffn:
            dropped.append(index)
            continue
        kv_heads = layer_rows(shapes, index, "self_attn.k_proj.weight") // head_dim if has_attention else 0
        width = layer_rows(shapes, index, "mlp.gate_proj.weight") if has_ffn else ZERO_FFN_WIDTH
        blocks.append(Block(index, heads if has_attention else 0, kv_heads, width, zero_ffn=not has_ffn))
    return blocks, dropped


def layer_rows(shapes: dict[str, tuple[int, ...]], index: int, rest: str) -> int:
    name = f"model.layers.{index}.{rest}"
    if name not in shapes:
        raise UnsupportedModelError(f"config.json keeps this sublayer of layer {index}, but {name} is missing")
    return shapes[name][0]


def layers_named(indices: list[int]) -> str:
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(map(str, indices))


def deci_notes(blocks: list[Block], dropped: list[int]) -> list[str]:
    notes = []
    if dropped:
        notes.append(f"{layers_named(dropped)} left out: both sublayers were removed, so the layer is the identity")
    zero = [block.source for block in blocks if block.zero_ffn]
    if zero:
        notes.append(f"attention-only {layers_named(zero)} written with a zero MLP of width {ZERO_FFN_WIDTH} (adds "
                     "exactly 0): llama.cpp's deci graph drops the attention output of a layer whose MLP width is 0")
    return notes


def deci_layout(config, shapes: dict[str, tuple[int, ...]]) -> Layout:
    """A sublayer cut: llama.cpp's deci graph, per-layer head counts and MLP widths, interleaved RoPE."""
    check_activation(config, "silu")
    blocks, dropped = deci_blocks(config, shapes)
    if not blocks:
        raise UnsupportedModelError("every layer of this nemotron-nas folder is empty; nothing to export")
    if blocks[0].heads == 0:
        raise UnsupportedModelError(f"layer {blocks[0].source}, the first non-empty one, has no attention: llama.cpp's "
                                    "deci graph reads head sizes from the first layer and cannot load this cut")
    return layout(gguf.MODEL_ARCH.DECI, config, blocks, permute_qk=True, arrays=True,
                  extra=rope_hparams(rope_parameters(config), "nemotron-nas"), notes=deci_notes(blocks, dropped),
                  dropped=dropped)
