"""A one-layer Llama whose four attention heads are set by hand to follow one pattern each.

Head dim 16 gives 8 RoPE pairs (i, i + 8) with theta_i = 10000^(-i/8): pair 0 turns once per token
(period 2*pi), pair 7 turns by 3e-4 (content channels that RoPE hardly moves over 128 tokens).
- head 0, re-access: a constant query in pair 7 meets a key that only the first token (a flag
  dimension in its embedding) produces: every query attends to position 0.
- head 1, sequential and positional: constant queries and keys in every pair, phased so that all
  pairs align at offset 1: the previous token wins whatever it is.
- head 2, seasonal and positional: constant query and key in pair 0 only: the logit is A cos(offset),
  high every 2*pi tokens.
- head 3, retrieval and symbolic: query and key are two different random projections of the token's
  content into the slow pairs: each token looks for the tokens its content prefers, wherever they are.
The MLP is switched off, so the layer's output is its input plus attention.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
HIDDEN = 64
HEAD_DIM = 16
HEADS = 4
FLAG = HIDDEN - 1  # embedding dimension that only the first token (id 0) has
EXPECTED = {0: "re-access", 1: "sequential", 2: "seasonal", 3: "retrieval"}
EXPECTED_SWAP = {1: "positional", 2: "positional", 3: "symbolic"}
SEASONAL_PERIOD = 2 * math.pi  # pair 0: theta = 1


def _pair(vector: torch.Tensor, pair: int, angle: float, size: float) -> None:
    """Put a 2-D vector of length `size` at `angle` into RoPE pair `pair` of one head's slice."""
    vector[pair] = size * math.cos(angle)
    vector[pair + HEAD_DIM // 2] = size * math.sin(angle)


def build_handset_model(seed: int = 0) -> LlamaForCausalLM:
    generator = torch.Generator().manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=1024, rope_theta=10000.0, attention_bias=True,
                         attn_implementation="eager", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    thetas = [10000.0 ** (-i / (HEAD_DIM // 2)) for i in range(HEAD_DIM // 2)]
    scale = math.sqrt(HEAD_DIM)  # undo the 1/sqrt(d) of the attention logits
    with torch.no_grad():
        embedding = torch.randn(VOCAB, HIDDEN, generator=generator)
        embedding[:, FLAG] = 0.0
        embedding[0] = 0.0
        embedding[0, FLAG] = 1.0  # after RMSNorm the first token's flag reads sqrt(HIDDEN) = 8
        model.model.embed_tokens.weight.copy_(embedding)
        attention = model.model.layers[0].self_attn
        for projection in (attention.q_proj, attention.k_proj):
            projection.weight.zero_()
            projection.bias.zero_()
        q_bias, k_bias = attention.q_proj.bias, attention.k_proj.bias
        q_weight, k_weight = attention.q_proj.weight, attention.k_proj.weight
        head = lambda h: slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)  # noqa: E731

        # head 0: query constant in pair 7; key = flag dimension, so only token 0 has one
        _pair(q_bias[head(0)], 7, 0.0, 20.0 * scale / math.sqrt(HIDDEN))
        k_weight[head(0)][7, FLAG] = 1.0
        # head 1: sum_i cos(theta_i (offset - 1)), peaked at offset 1
        for i, theta in enumerate(thetas):
            _pair(q_bias[head(1)], i, -theta, 40.0 * scale)
            _pair(k_bias[head(1)], i, 0.0, 1.0)
        # head 2: A cos(offset) from pair 0 alone
        _pair(q_bias[head(2)], 0, 0.0, 30.0 * scale)
        _pair(k_bias[head(2)], 0, 0.0, 1.0)
        # head 3: q = P_a x, k = P_b x in the two slowest pairs (4 dims), random content matching
        for dims in (6, 7, 14, 15):
            q_weight[head(3)][dims] = torch.randn(HIDDEN, generator=generator) * 2.0
            k_weight[head(3)][dims] = torch.randn(HIDDEN, generator=generator) * 2.0
        model.model.layers[0].mlp.down_proj.weight.zero_()
    return model


def handset_windows(windows: int = 6, seq_len: int = 128, seed: int = 1) -> torch.Tensor:
    """Token windows that start with the flagged first token, then random content."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (windows, seq_len), generator=generator)
    ids[:, 0] = 0
    return ids
