"""The tiny checkpoints are real, loadable models, and the slow reference scorer is right.

Every later scoring test compares production numbers with `reference.reference_scores`, so
this file checks the reference itself: the Gram-matrix shortcut against a brute-force pair
loop, and the independently rebuilt post-RoPE queries against the attention weights the model's
own eager kernel produces (which pins q_norm placement, per-type RoPE bases, partial rotary,
GQA, sliding windows and softcapping).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reference import capture_window, reference_scores
from tiny_models import ARCHITECTURES, SLIDING_WINDOW

TEXT = (
    "Once upon a time there was a little village by the sea. The people of the village went "
    "fishing every morning and came back in the evening with baskets full of fish, while the "
    "children built castles of sand and watched ships sail past the old lighthouse."
)
EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
}


def _load(path, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def _windows(tok, w: int, t: int) -> torch.Tensor:
    ids = tok(TEXT, return_tensors="pt").input_ids[0]
    assert ids.numel() >= w * t, "TEXT too short for the requested windows"
    return ids[: w * t].reshape(w, t)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_loads_and_decodes(arch, tiny_checkpoint):
    """Greedy generate with the KV cache must equal a cache-free greedy loop (sliding windows included)."""
    model, tok = _load(tiny_checkpoint(arch))
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    assert len(model.get_decoder().layers) == 6
    prompt = tok("The people of the village", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(prompt).logits
        assert torch.isfinite(logits).all()
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
        ids = prompt
        for _ in range(gen.shape[1] - prompt.shape[1]):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert gen.shape[1] > prompt.shape[1]
    assert gen.tolist() == ids.tolist()


def test_tokenizer_round_trips_any_text(tiny_checkpoint):
    """Byte-level BPE: arbitrary Unicode encodes and decodes losslessly; BOS is prepended."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    text = "Grüße, 世界! naïve café 🦊 — tabs\tand\nnewlines"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert 300 <= len(tok) <= 400
    assert {tok.pad_token, tok.bos_token, tok.eos_token} == {"<pad>", "<s>", "</s>"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reference_scores_ranges(arch, tiny_checkpoint):
    """Shapes and ranges of every reference score on two windows longer than the sliding window."""
    model, tok = _load(tiny_checkpoint(arch))
    n_layers, heads = 6, 4
    scores = reference_scores(model, _windows(tok, 2, 2 * SLIDING_WINDOW))
    for key in ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1", "block_influence"):
        assert len(scores[key]) == n_layers, key
        assert all(math.isfinite(v) for v in scores[key]), key
    for key in ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1"):
        assert all(-1 <= v <= 1 for v in scores[key]), key
    assert len(set(round(v, 6) for v in scores["q_similarity"])) == n_layers  # not degenerate
    assert all(0 <= v <= 2 for v in scores["block_influence"])
    hq = torch.tensor(scores["heads_q_similarity"])
    assert hq.shape == (n_layers, heads)
    assert torch.allclose(hq.mean(-1), torch.tensor(scores["q_similarity"], dtype=hq.dtype))
    ang = torch.tensor(scores["angular_distance"])
    assert ang.shape == (n_layers + 1, n_layers + 1)
    assert torch.equal(ang, ang.T)
    assert torch.all(ang.diagonal() == 0)
    assert ang.min() >= 0 and ang.max() <= 1
    assert ang[0, -1] > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gram_similarity_equals_pair_loop(arch, tiny_checkpoint):
    """The Gram-matrix formula equals a literal double loop over ordered pairs i != j (T = 5)."""
    model, tok = _load(tiny_checkpoint(arch))
    window = _windows(tok, 1, 5)
    layer = 2
    q = capture_window(model, window[0])[0][layer]["pre"]  # [H, T, D]
    heads, t = q.shape[0], q.shape[1]
    per_head = []
    for h in range(heads):
        total = 0.0
        for i in range(t):
            for j in range(t):
                if i != j:
                    a, b = q[h, i], q[h, j]
                    total += (torch.dot(a, b) / (a.norm() * b.norm())).item()
        per_head.append(total / (t * (t - 1)))
    scores = reference_scores(model, window)
    assert scores["heads_q_similarity"][layer] == pytest.approx(per_head, abs=1e-12)
    assert scores["q_similarity"][layer] == pytest.approx(sum(per_head) / heads, abs=1e-12)
    lag = sum(
        (torch.dot(q[h, i], q[h, i + 1]) / (q[h, i].norm() * q[h, i + 1].norm())).item()
        for h in range(heads)
        for i in range(t - 1)
    ) / (heads * (t - 1))
    assert scores["q_similarity_lag1"][layer] == pytest.approx(lag, abs=1e-12)


def _attention_probs(attn, q: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
    """softmax(mask(softcap(q k^T * scaling))) with GQA, causal and sliding-window masking; float64."""
    n_rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(n_rep, dim=0)  # query head h uses KV head h // n_rep
    scores = q @ k.transpose(-1, -2) * attn.scaling
    softcap = getattr(attn, "attn_logit_softcapping", None)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t = q.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_post_rope_queries_reproduce_eager_attention(arch, tiny_checkpoint):
    """Rebuilt post-RoPE q and k give the eager kernel's attention weights in every layer."""
    model, tok = _load(tiny_checkpoint(arch), attn_implementation="eager")
    cfg = model.config.get_text_config(decoder=True)
    window = _windows(tok, 1, 2 * SLIDING_WINDOW)[0]
    layers, out = capture_window(model, window, output_attentions=True)
    assert len(out.attentions) == len(layers)
    windows_seen = set()
    for i, (layer, cap) in enumerate(zip(model.get_decoder().layers, layers)):
        attn = layer.self_attn
        sw = getattr(attn, "sliding_window", getattr(cfg, "sliding_window", None))
        windows_seen.add(sw)
        probs = _attention_probs(attn, cap["post"], cap["post_k"], sw)
        torch.testing.assert_close(probs, out.attentions[i][0].to(torch.float64), atol=2e-5, rtol=1e-4)
        # pre-RoPE and post-RoPE queries really differ (RoPE was applied at positions > 0)
        assert not torch.allclose(cap["pre"][:, 1:], cap["post"][:, 1:])
    expected = {"llama": {None}, "phi3": {None}, "mistral": {SLIDING_WINDOW}}.get(arch, {None, SLIDING_WINDOW})
    assert windows_seen == expected


def _saved_keys(path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            keys |= set(s.keys())
    return keys


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_saved_key_layout(arch, tiny_checkpoint):
    """Pin where the decoder lives in the saved safetensors (Gemma3 multimodal keeps the legacy hub prefix)."""
    keys = _saved_keys(tiny_checkpoint(arch))
    prefix = "language_model.model." if arch == "gemma3" else "model."
    assert {f"{prefix}layers.{i}.input_layernorm.weight" for i in range(6)} <= keys
    q_key = "self_attn.qkv_proj.weight" if arch == "phi3" else "self_attn.q_proj.weight"
    assert f"{prefix}layers.0.{q_key}" in keys
    if arch == "gemma3":
        assert any(k.startswith("vision_tower.") for k in keys)
        assert any(k.startswith("multi_modal_projector.") for k in keys)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sharded_checkpoint_matches_single_file(arch, tiny_checkpoint):
    """max_shard_size gives an indexed multi-shard checkpoint with the same (seeded) weights."""
    sharded = tiny_checkpoint(arch, max_shard_size="20KB")
    single = tiny_checkpoint(arch)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    a = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    b = AutoModelForCausalLM.from_pretrained(single).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_hooks_match_hidden_states(arch, tiny_checkpoint):
    """Hooked layer inputs/outputs equal output_hidden_states, except the last entry, which is after the final norm.

    This is why block influence and angular distance hook the layers instead of using hidden_states[-1].
    """
    model, tok = _load(tiny_checkpoint(arch))
    layers, out = capture_window(model, _windows(tok, 1, 12)[0], output_hidden_states=True)
    hs = [h[0].to(torch.float64) for h in out.hidden_states]
    assert len(hs) == len(layers) + 1
    for i, cap in enumerate(layers):
        assert torch.equal(cap["h_in"], hs[i])
        if i < len(layers) - 1:
            assert torch.equal(cap["h_out"], hs[i + 1])
    last = layers[-1]["h_out"]
    assert not torch.allclose(last, hs[-1])
    normed = model.get_decoder().norm(last.to(torch.float32)).to(torch.float64)
    torch.testing.assert_close(normed, hs[-1])


def test_fast_tests_use_an_isolated_cache(tmp_path_factory):
    """The autouse fixture points PRUNETOOL_CACHE_DIR into this session's temp tree."""
    import os
    from pathlib import Path

    cache = Path(os.environ["PRUNETOOL_CACHE_DIR"]).resolve()
    assert cache.is_relative_to(tmp_path_factory.getbasetemp().resolve())
    assert torch.get_num_threads() == 1
