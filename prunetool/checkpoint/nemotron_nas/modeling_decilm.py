"""A nemotron-nas (DeciLM) model for transformers: Llama layers where some attention or MLP sublayers are absent.

Written by the prunetool authors from the format's description, on transformers' own Llama building blocks.
This file is copied into every folder `prunetool prune --unit attention|mlp` writes and is loaded with
`trust_remote_code=True`; it imports only torch and transformers.

A layer whose attention is a no-op has no input norm and no attention and adds nothing to the stream;
likewise for the MLP and its norm. The KV cache holds only the attention layers: the attention modules
are numbered 0..A-1 in order, so a cache built for the first A layers serves them and the cache's length
is read from an attention layer, never from a removed one. Weight names are Llama's.
"""

import copy

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                                      LlamaPreTrainedModel, LlamaRMSNorm)

from .configuration_decilm import DeciLMConfig


def intermediate_size_of(ffn, hidden_size: int) -> int:
    """The MLP width a block config describes: from ffn_mult, rounded up to a multiple of 256, else as given."""
    if getattr(ffn, "ffn_mult", None) is None:
        return ffn.intermediate_size
    width = int(2 * ffn.ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


def layer_config(config: DeciLMConfig, block) -> DeciLMConfig:
    """The Llama configuration of one layer's sublayers: its key/value heads and MLP width."""
    own = copy.copy(config)
    if not block.attention.no_op:
        own.num_key_value_heads = config.num_attention_heads // block.attention.n_heads_in_group
    if not block.ffn.no_op:
        own.intermediate_size = intermediate_size_of(block.ffn, config.hidden_size)
    return own


class DeciLMDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DeciLMConfig, layer_idx: int, cache_index: int):
        super().__init__()
        block = config.block_configs[layer_idx]
        own = layer_config(config, block)
        self.attention_is_no_op, self.ffn_is_no_op = bool(block.attention.no_op), bool(block.ffn.no_op)
        if not self.attention_is_no_op:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attn = LlamaAttention(config=own, layer_idx=cache_index)
            if getattr(config, "qkv_bias", False) and not config.attention_bias:  # Qwen2: q, k and v have a bias
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(self.self_attn, name)
                    setattr(self.self_attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        if not self.ffn_is_no_op:
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = LlamaMLP(own)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, past_key_values=None, **kwargs):
        if not self.attention_is_no_op:
            attended, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, cache=cache if cache is not None else past_key_values,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            hidden_states = hidden_states + attended
        if not self.ffn_is_no_op:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMPreTrainedModel(LlamaPreTrainedModel):
    config_class = DeciLMConfig
    _no_split_modules = ["DeciLMDecoderLayer"]


class DeciLMModel(DeciLMPreTrainedModel, LlamaModel):
    def __init__(self, config: DeciLMConfig):
        skeleton = copy.copy(config)
        skeleton.num_hidden_layers = 0  # Llama's own layers are never built; ours replace them
        LlamaModel.__init__(self, skeleton)
        self.config = config
        cache_indices, count = [], 0
        for block in config.block_configs:
            cache_indices.append(count)
            count += 0 if block.attention.no_op else 1
        self.layers = nn.ModuleList(DeciLMDecoderLayer(config, index, cache_indices[index])
                                    for index in range(config.num_hidden_layers))
        self.post_init()


class DeciLMForCausalLM(DeciLMPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: DeciLMConfig):
        DeciLMPreTrainedModel.__init__(self, config)
        self.model = DeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
