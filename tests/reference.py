"""Slow, explicit reference implementation of prunetool's layer scores.

Deliberately independent of the `prunetool` package: the production code computes the same
numbers with streaming O(T*d) reductions and a capture wrapper around the attention kernel;
this file uses forward hooks, full T x T Gram matrices, per-window Python loops and float64,
so that an agreement between the two is evidence rather than the same bug computed twice.

Definitions (TAPPA query self-similarity; ShortGPT block influence; Gromov et al. angular
distance) are spelled out in `reference_scores`.
"""

from __future__ import annotations

import inspect
import math

import torch

F64 = torch.float64

# Where q_norm sits relative to the [B,T,H,D] -> [B,H,T,D] transpose, per model_type.
# Qwen3 normalises before the transpose, Gemma3 after it.
_Q_NORM_LAYOUT = {"qwen3": "BTHD", "gemma3_text": "BHTD", "gemma3": "BHTD"}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The standard RoPE helper: [x1, x2] -> [-x2, x1] on the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [H,T,D] with cos/sin [T,R]; only the first R dims rotate (Phi3 partial rotary)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def _head_dims(model) -> tuple[int, int, int]:
    cfg = _text_config(model)
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return h, hkv, d


def _rope_tables(decoder, attn, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T,R] in float64 for positions 0..T-1 from the model's own rotary module.

    Gemma3's rotary module takes a layer_type and has a different base per type, so the
    attention module's own `layer_type` picks the table.
    """
    position_ids = torch.arange(t, device=device).unsqueeze(0)
    dummy = torch.zeros(1, t, 1, dtype=F64, device=device)
    params = inspect.signature(decoder.rotary_emb.forward).parameters
    if "layer_type" in params:
        cos, sin = decoder.rotary_emb(dummy, position_ids, attn.layer_type)
    else:
        cos, sin = decoder.rotary_emb(dummy, position_ids)
    return cos[0].to(device="cpu", dtype=F64), sin[0].to(device="cpu", dtype=F64)


def _to_heads(x: torch.Tensor, n: int, d: int, layout: str = "BTHD") -> torch.Tensor:
    """Hook output for one window (B=1) -> [n, T, d] float64 on the CPU."""
    x = x.detach().to(device="cpu", dtype=F64)[0]
    if layout == "BHTD":
        return x.reshape(n, -1, d)
    return x.reshape(x.shape[0], n, d).transpose(0, 1)


def _output_hook(store: dict, key: tuple):
    """Forward hook saving the module output (decoder layers may return a tuple)."""

    def hook(module, args, kwargs, out):
        store[key] = (out[0] if isinstance(out, tuple) else out).detach()

    return hook


def _layer_input_hook(store: dict, key: tuple):
    """Forward pre-hook saving a decoder layer's input hidden states (positional or keyword)."""

    def hook(module, args, kwargs):
        store[key] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()

    return hook


def _install_hooks(model, store: dict) -> list:
    """Hooks filling store[(kind, layer)]: layer in/out, q/k projections (or Phi3's fused qkv), q/k norms."""
    hooks = []
    for i, layer in enumerate(model.get_decoder().layers):
        attn = layer.self_attn
        hooks.append(layer.register_forward_pre_hook(_layer_input_hook(store, ("h_in", i)), with_kwargs=True))
        hooks.append(layer.register_forward_hook(_output_hook(store, ("h_out", i)), with_kwargs=True))
        hooks.append(attn.register_forward_hook(_output_hook(store, ("attn_out", i)), with_kwargs=True))
        if hasattr(attn, "qkv_proj"):
            projections = {"qkv_proj": attn.qkv_proj}
        else:
            projections = {"q_proj": attn.q_proj, "k_proj": attn.k_proj}
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                projections[name] = getattr(attn, name)
        for name, module in projections.items():
            hooks.append(module.register_forward_hook(_output_hook(store, (name, i)), with_kwargs=True))
    return hooks


def _layer_queries(store: dict, i: int, model) -> tuple[torch.Tensor, ...]:
    """(pre-RoPE q, q as RoPE sees it, k as RoPE sees it) for layer i, each [heads, T, D]."""
    h, hkv, d = _head_dims(model)
    if ("qkv_proj", i) in store:  # Phi3: [q | k | v] along the output dim
        qkv = store[("qkv_proj", i)]
        q_raw, k_raw = qkv[..., : h * d], qkv[..., h * d : (h + hkv) * d]
    else:
        q_raw, k_raw = store[("q_proj", i)], store[("k_proj", i)]
    pre = _to_heads(q_raw, h, d)
    if ("q_norm", i) not in store:
        return pre, pre, _to_heads(k_raw, hkv, d)
    model_type = _text_config(model).model_type
    if model_type not in _Q_NORM_LAYOUT:
        raise NotImplementedError(f"q_norm layout unknown for model_type {model_type!r}")
    layout = _Q_NORM_LAYOUT[model_type]
    return pre, _to_heads(store[("q_norm", i)], h, d, layout), _to_heads(store[("k_norm", i)], hkv, d, layout)


@torch.no_grad()
def capture_window(model, window: torch.Tensor, **forward_kwargs) -> tuple[list[dict], object]:
    """Run one window [T] through the decoder; per layer return float64 CPU tensors.

    Each entry: pre [H,T,D] (q_proj output, before q_norm and RoPE), post [H,T,D] (after q_norm
    and RoPE, what the attention kernel sees), post_k [Hkv,T,D], h_in / h_out [T,hidden].
    Also returns the decoder output (for `output_attentions` checks).
    """
    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    store: dict = {}
    hooks = _install_hooks(model, store)
    try:
        out = decoder(input_ids=window.reshape(1, -1).to(device), use_cache=False, **forward_kwargs)
    finally:
        for hk in hooks:
            hk.remove()
    layers = []
    for i, layer in enumerate(decoder.layers):
        pre, q_in, k_in = _layer_queries(store, i, model)
        cos, sin = _rope_tables(decoder, layer.self_attn, window.numel(), device)
        layers.append(
            dict(
                pre=pre,
                post=apply_rope(q_in, cos, sin),
                post_k=apply_rope(k_in, cos, sin),
                h_in=store[("h_in", i)][0].to(device="cpu", dtype=F64),
                h_out=store[("h_out", i)][0].to(device="cpu", dtype=F64),
                attn_out=store[("attn_out", i)][0].to(device="cpu", dtype=F64),
            )
        )
    return layers, out


def gram_similarity(q: torch.Tensor) -> torch.Tensor:
    """Per head: mean cosine over ordered pairs i != j, via the full T x T Gram matrix. q: [H,T,D] -> [H]."""
    u = q / q.norm(dim=-1, keepdim=True)
    gram = u @ u.transpose(-1, -2)  # [H, T, T]
    t = q.shape[-2]
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return (gram.sum(dim=(-1, -2)) - trace) / (t * (t - 1))


def lag1_similarity(q: torch.Tensor) -> torch.Tensor:
    """Per head: mean cosine of consecutive queries (t, t+1). q: [H,T,D] -> [H]."""
    return torch.cosine_similarity(q[:, :-1], q[:, 1:], dim=-1).mean(-1)


def _angle(a: torch.Tensor, b: torch.Tensor) -> float:
    c = torch.dot(a, b) / (a.norm() * b.norm())
    return math.acos(max(-1.0, min(1.0, c.item()))) / math.pi


def angular_matrix(states: list[torch.Tensor]) -> list[list[float]]:
    """(1/pi) * arccos(cos) between every pair of vectors; filled as a symmetric matrix.

    The diagonal is set to exactly 0: it is 0 by definition, and arccos near 1 turns float
    rounding into ~1e-8 noise.
    """
    n = len(states)
    m = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            m[a][b] = m[b][a] = _angle(states[a], states[b])
    return m


def reference_scores(model, input_ids: torch.Tensor) -> dict:
    """All per-layer scores for windows input_ids [W, T] (each window run alone, no padding).

    * q_similarity[l]: mean over windows of mean over heads of the mean pairwise (i != j) cosine
      of pre-RoPE, pre-q_norm queries.  heads_q_similarity[l][h]: the same before the head mean.
    * q_similarity_post_rope[l]: the same on post-q_norm, post-RoPE queries.
    * q_similarity_lag1[l]: mean cosine of consecutive pre-RoPE queries (heads, then windows).
    * block_influence[l]: 1 - cos(layer input, layer output), mean over all tokens of all windows.
    * angular_distance[a][b]: (1/pi) arccos cos(h_a, h_b) of the last token, where h_l is the
      input of layer l and h_L the output of the last layer (before the final norm); window mean.
    * attention_influence / mlp_influence[l]: 1 - cos across the sublayer, where the stream between
      the sublayers is rebuilt as layer input + self_attn output (pre-norm layers without sandwich
      norms only); attention_angular / mlp_angular: the last token's angle across it, window mean.
    """
    input_ids = torch.as_tensor(input_ids).reshape(-1, input_ids.shape[-1])
    w = input_ids.shape[0]
    n_layers = len(model.get_decoder().layers)
    heads_pre, heads_post, lag1 = [], [], []  # each [W, L, H]
    bi_sum, bi_count = torch.zeros(n_layers, dtype=F64), 0
    ang = torch.zeros(n_layers + 1, n_layers + 1, dtype=F64)
    across = {name: torch.zeros(n_layers, dtype=F64) for name in
              ("attention_influence", "mlp_influence", "attention_angular", "mlp_angular")}
    for window in input_ids:
        layers, _ = capture_window(model, window)
        heads_pre.append(torch.stack([gram_similarity(x["pre"]) for x in layers]))
        heads_post.append(torch.stack([gram_similarity(x["post"]) for x in layers]))
        lag1.append(torch.stack([lag1_similarity(x["pre"]) for x in layers]))
        for i, x in enumerate(layers):
            bi_sum[i] += (1 - torch.cosine_similarity(x["h_in"], x["h_out"], dim=-1)).sum()
            middle = x["h_in"] + x["attn_out"]
            for unit, (a, b) in (("attention", (x["h_in"], middle)), ("mlp", (middle, x["h_out"]))):
                across[f"{unit}_influence"][i] += (1 - torch.cosine_similarity(a, b, dim=-1)).sum()
                across[f"{unit}_angular"][i] += _angle(a[-1], b[-1])
        bi_count += window.numel()
        states = [x["h_in"][-1] for x in layers] + [layers[-1]["h_out"][-1]]
        ang += torch.tensor(angular_matrix(states), dtype=F64)
    heads_pre_t = torch.stack(heads_pre).mean(0)  # [L, H]
    return {
        "q_similarity": heads_pre_t.mean(-1).tolist(),
        "q_similarity_post_rope": torch.stack(heads_post).mean(-1).mean(0).tolist(),
        "q_similarity_lag1": torch.stack(lag1).mean(-1).mean(0).tolist(),
        "block_influence": (bi_sum / bi_count).tolist(),
        "heads_q_similarity": heads_pre_t.tolist(),
        "angular_distance": (ang / w).tolist(),
        "attention_influence": (across["attention_influence"] / bi_count).tolist(),
        "mlp_influence": (across["mlp_influence"] / bi_count).tolist(),
        "attention_angular": (across["attention_angular"] / w).tolist(),
        "mlp_angular": (across["mlp_angular"] / w).tolist(),
    }
