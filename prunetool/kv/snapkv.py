"""SnapKV-style KV-cache compression at prefill, on transformers 5.x's attention interface.

SnapKV (Li et al., 2024, arXiv 2404.14469) keeps, per layer and KV head, the prompt positions that an
observation window at the end of the prompt attends to most, plus the window itself. Here:

- `prefill` runs the prompt through the model once with the attention function the model already uses
  (sdpa or eager) wrapped: it computes exactly what it computed before, and for each layer also keeps the
  keys and values and scores every position by the attention the last `window` queries pay it (summed over
  those queries, averaged over the query heads that share the KV head). That is window x T logits per
  head, never T x T. It also keeps the window's post-RoPE query self-similarity (TAPPA's schedule).
- `compress` keeps, per layer and KV head, the window and the best-scored other positions up to the layer's
  budget (a budget at or below the window: the best-scored positions of the whole prompt). Scores are
  max-pooled over 7 neighbours as in SnapKV, ties broken by the position's own score.
- `continuation_logprobs` and `greedy_generate` run the model without a transformers cache: the wrapped
  function attends over the kept keys and values plus the new tokens', masked by original positions (causal,
  and within the sliding window where the layer has one). So every layer can keep a different number of
  positions, and RoPE positions continue from the prompt's end.

The prompt's last token is left out of the prefill and fed with the continuation, so every scored token,
the first one included, is predicted from the compressed cache.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prunetool.model.architecture import inspect_decoder
from prunetool.kv.schedules import RECENT_QUERIES
from prunetool.model.loading import input_device
from prunetool.model.metrics import mean_pairwise_cosine

WINDOW = 32  # SnapKV's observation window
POOL = 7  # SnapKV's pooling kernel


@dataclass
class LayerPrefill:
    keys: torch.Tensor  # (1, kv_heads, T, d), post-RoPE
    values: torch.Tensor  # (1, kv_heads, T, d)
    scores: torch.Tensor  # (kv_heads, T) float32: attention paid by the window, group-averaged
    q_similarity: float  # mean pairwise cosine of the last RECENT_QUERIES post-RoPE queries, head-averaged
    dispersion: float  # mean entropy of the window's attention rows (nats)
    shift: float  # variance of each position's attention across the window's queries, summed over positions
    sliding_window: int | None


@dataclass
class Prefill:
    """One prompt's prefill (all but its last token): what every schedule and budget compresses from."""

    layers: list[LayerPrefill]
    length: int  # tokens prefilled
    last_token: int  # the prompt's last token, fed with the continuation
    window: int
    seconds: float

    @property
    def caps(self) -> list[int]:
        """What each layer can use: the prompt, or the positions its sliding window still sees next step."""
        return [min(self.length, layer.sliding_window - 1) if layer.sliding_window else self.length
                for layer in self.layers]

    @property
    def q_similarity(self) -> list[float]:
        return [layer.q_similarity for layer in self.layers]

    @property
    def preference(self) -> list[float]:
        """CAKE's layer preference: attention dispersion times temporal shift."""
        return [layer.dispersion * layer.shift for layer in self.layers]

    @property
    def full_attention(self) -> list[bool]:
        return [layer.sliding_window is None for layer in self.layers]


PAD = 2**62  # position of a padding slot in stacked caches: after every query, so never visible


@dataclass
class KeptCache:
    """Per layer: the kept keys and values and their original positions, per row and KV head.

    One row per compressed cache; `stack` puts several caches of the same prompt in one batch (each layer
    padded to its longest row with slots no query can see), so every schedule decodes in one forward.
    """

    keys: list[torch.Tensor]  # (rows, kv_heads, B_l, d)
    values: list[torch.Tensor]
    positions: list[torch.Tensor]  # (rows, kv_heads, B_l) long; PAD where a row has fewer
    next_position: int
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def kept(self) -> list[int]:
        """Positions each layer keeps (first row, first KV head; every head keeps as many)."""
        return [int((positions[0, 0] != PAD).sum()) for positions in self.positions]

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)
        self.values[layer] = torch.cat([self.values[layer], values], dim=2)
        grown = positions.expand(keys.shape[0], keys.shape[1], -1)
        self.positions[layer] = torch.cat([self.positions[layer], grown], dim=2)


def stack(caches: list[KeptCache]) -> KeptCache:
    """Several one-row caches of the same prompt as one cache of as many rows."""
    if len({cache.next_position for cache in caches}) != 1:
        raise ValueError("only caches of the same prompt can be stacked")
    keys, values, positions = [], [], []
    for layer in range(len(caches[0].keys)):
        longest = max(cache.keys[layer].shape[2] for cache in caches)

        def padded(tensor, fill):
            missing = longest - tensor.shape[2]
            if not missing:
                return tensor
            shape = (*tensor.shape[:2], missing, *tensor.shape[3:])
            return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=2)

        keys.append(torch.cat([padded(cache.keys[layer], 0) for cache in caches]))
        values.append(torch.cat([padded(cache.values[layer], 0) for cache in caches]))
        positions.append(torch.cat([padded(cache.positions[layer], PAD) for cache in caches]))
    return KeptCache(keys, values, positions, caches[0].next_position)


@dataclass
class _Session:
    """What the wrapped attention function does on this forward."""

    attentions: tuple  # the decoder's attention modules, in layer order
    mode: str  # "prefill" or "decode"
    window: int = WINDOW
    recorded: dict[int, LayerPrefill] = field(default_factory=dict)
    cache: KeptCache | None = None
    positions: torch.Tensor | None = None  # decode: original positions of the new tokens, (q,)
    commit: bool = False  # decode: append the new tokens' keys and values to the cache

    def __post_init__(self):
        self.layer_of = {id(attention): index for index, attention in enumerate(self.attentions)}  # id -> layer


_SESSION: _Session | None = None


def _logits(query, keys, scaling, softcap):
    logits = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def window_scores(query, keys, *, window: int, scaling: float, softcap: float | None,
                  sliding_window: int | None) -> tuple[torch.Tensor, float, float]:
    """(1, H, T, d) queries and (1, K, T, d) keys -> (K, T) attention the last `window` queries pay each
    position; the mean entropy (nats) of those attention rows and the mean variance of each position's
    attention across the window's queries (CAKE's spatial dispersion and temporal shift).

    Only the window's rows of the attention are formed (window x T per head), with the model's own causal and
    sliding-window rules, softmax in float32, summed over the window and averaged over each KV head's group.
    """
    heads, kv_heads, length = query.shape[1], keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    rows = min(window, length)
    grouped = query[:, :, -rows:].reshape(1, kv_heads, groups * rows, query.shape[-1])  # each group's window rows
    logits = _logits(grouped, keys, scaling, softcap).view(kv_heads, groups, rows, length)
    q_pos = torch.arange(length - rows, length, device=keys.device)[:, None]
    k_pos = torch.arange(length, device=keys.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window:
        visible &= (q_pos - k_pos) < sliding_window
    attention = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # (K, g, w, T)
    entropy = -(attention * attention.clamp_min(1e-30).log()).sum(dim=-1).mean()
    shift = attention.var(dim=2, unbiased=False).sum(dim=-1).mean() if rows > 1 else attention.new_zeros(())
    return attention.sum(dim=2).mean(dim=1), float(entropy), float(shift)


def _record(session: _Session, module, query, key, value, kwargs) -> None:
    layer = session.layer_of[id(module)]
    scaling = kwargs.get("scaling") or module.head_dim ** -0.5
    sliding = kwargs.get("sliding_window")
    scores, dispersion, shift = window_scores(query, key, window=session.window, scaling=scaling,
                                       softcap=kwargs.get("softcap"), sliding_window=sliding)
    recent = query[0, :, -RECENT_QUERIES:]
    similarity = float(mean_pairwise_cosine(recent).mean()) if recent.shape[1] >= 2 else 1.0
    session.recorded[layer] = LayerPrefill(key.detach(), value.detach(), scores, similarity, dispersion, shift,
                                           sliding or None)


def _decode_attention(session: _Session, module, query, key, value, kwargs):
    """Attention of the new tokens over the kept cache plus themselves, masked by original positions."""
    layer = session.layer_of[id(module)]
    cache = session.cache
    batch, heads, new = query.shape[0], query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    stored_keys, stored_values, stored_positions = cache.keys[layer], cache.values[layer], cache.positions[layer]
    if stored_keys.shape[0] != batch:  # one cache, several continuations
        stored_keys, stored_values = stored_keys.expand(batch, -1, -1, -1), stored_values.expand(batch, -1, -1, -1)
        stored_positions = stored_positions.expand(batch, -1, -1)
    keys = torch.cat([stored_keys.to(key.dtype), key], dim=2)
    values = torch.cat([stored_values.to(value.dtype), value], dim=2)
    q_pos = session.positions  # (new,)
    k_pos = torch.cat([stored_positions, q_pos.expand(batch, kv_heads, -1)], dim=2)  # (b, K, B + new)
    visible = k_pos[:, :, None, :] <= q_pos[None, None, :, None]  # (b, K, new, B + new)
    sliding = kwargs.get("sliding_window")
    if sliding:
        visible &= (q_pos[None, None, :, None] - k_pos[:, :, None, :]) < sliding
    scaling = kwargs.get("scaling") or module.head_dim ** -0.5
    # each KV head's group of query heads as extra query rows: (b, K, g * new, d), no copies of the keys
    grouped = query.reshape(batch, kv_heads, groups * new, query.shape[-1])
    logits = _logits(grouped, keys, scaling, kwargs.get("softcap"))  # (b, K, g * new, B + new)
    mask = visible[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, kv_heads, groups * new, -1)
    attention = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    output = torch.matmul(attention, values.float()).to(query.dtype).view(batch, heads, new, -1)
    if session.commit:
        cache.append(layer, key.detach(), value.detach(), q_pos)
    return output.transpose(1, 2).contiguous(), None


def _dispatch(original, module, query, key, value, attention_mask, **kwargs):
    session = _SESSION
    if session is None or id(module) not in session.layer_of:
        return original(module, query, key, value, attention_mask, **kwargs)
    if session.mode == "prefill":
        output = original(module, query, key, value, attention_mask, **kwargs)
        _record(session, module, query, key, value, kwargs)
        return output
    return _decode_attention(session, module, query, key, value, kwargs)


@contextmanager
def _wrapped_attention(session: _Session):
    """Route the model's attention implementation through `_dispatch` for the duration of one forward."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _SESSION
    key = session.attentions[0].config._attn_implementation or "eager"
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    missing = object()
    previous = mapping.get(key, missing)

    def original(module, *args, **kwargs):
        function = previous if previous is not missing else sys.modules[type(module).__module__].eager_attention_forward
        return function(module, *args, **kwargs)

    mapping[key] = lambda *args, **kwargs: _dispatch(original, *args, **kwargs)
    _SESSION = session
    try:
        yield session
    finally:
        _SESSION = None
        if previous is missing:
            del mapping[key]
        else:
            mapping[key] = previous


@torch.no_grad()
def prefill(model, input_ids: list[int], *, window: int = WINDOW) -> Prefill:
    """Run all but the prompt's last token; keep every layer's keys, values, window scores and query similarity."""
    if len(input_ids) < 2:
        raise ValueError("a prompt needs at least 2 tokens to be compressed")
    clock = time.perf_counter()
    session = _Session(inspect_decoder(model).attentions, "prefill", window=window)
    device = input_device(model)
    ids = torch.tensor([input_ids[:-1]], device=device)
    with _wrapped_attention(session):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    layers = [session.recorded[index] for index in range(len(session.attentions))]
    return Prefill(layers, len(input_ids) - 1, input_ids[-1], window, time.perf_counter() - clock)


def keep_positions(scores: torch.Tensor, budget: int, *, window: int, first_visible: int = 0) -> torch.Tensor:
    """(K, T) scores -> (K, budget) sorted positions: the window, then the best pooled scores before it.

    Positions before `first_visible` (outside a sliding window) are never kept. With a budget at or below the
    window, every visible position competes on its score.
    """
    kv_heads, length = scores.shape
    visible = length - first_visible
    if budget >= visible:
        return torch.arange(first_visible, length, device=scores.device).expand(kv_heads, -1)
    pooled = F.max_pool1d(scores[None], kernel_size=POOL, stride=1, padding=POOL // 2)[0] if length >= POOL else scores
    rank = pooled + 1e-6 * scores  # neighbours of a hot position rank just below it
    rank[:, :first_visible] = float("-inf")
    window = min(window, visible)
    if budget > window:
        rank[:, length - window:] = float("inf")
    chosen = rank.topk(budget, dim=-1).indices
    return chosen.sort(dim=-1).values


def compress(prefilled: Prefill, budgets: list[int]) -> KeptCache:
    """Keep each layer's budget of positions per KV head (a budget at or above what it can see keeps all)."""
    clock = time.perf_counter()
    keys, values, positions = [], [], []
    for layer, budget in zip(prefilled.layers, budgets):
        length = layer.keys.shape[2]
        first = max(0, length - (layer.sliding_window - 1)) if layer.sliding_window else 0
        kept = keep_positions(layer.scores, budget, window=prefilled.window, first_visible=first)
        index = kept[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
        keys.append(layer.keys.gather(2, index))
        values.append(layer.values.gather(2, index))
        positions.append(kept[None])
    return KeptCache(keys, values, positions, prefilled.length, time.perf_counter() - clock)


def full_cache(prefilled: Prefill) -> KeptCache:
    """Everything each layer can still see: the uncompressed reference."""
    return compress(prefilled, prefilled.caps)


def _decode(model, cache: KeptCache, ids: torch.Tensor, *, commit: bool) -> torch.Tensor:
    """Logits of `ids` (rows x new tokens) placed right after the prompt, through the kept cache."""
    positions = torch.arange(cache.next_position, cache.next_position + ids.shape[1], device=ids.device)
    session = _Session(inspect_decoder(model).attentions, "decode", cache=cache, positions=positions, commit=commit)
    with _wrapped_attention(session):
        return model(input_ids=ids, position_ids=positions.expand(ids.shape[0], -1), use_cache=False).logits


@torch.no_grad()
def next_token_logprobs(model, cache: KeptCache, last_token: int) -> torch.Tensor:
    """(rows, vocab) log-probabilities of the token after the prompt, one row per cache row."""
    ids = torch.full((cache.rows, 1), last_token, device=input_device(model))
    return _decode(model, cache, ids, commit=False)[:, -1].float().log_softmax(dim=-1)


@torch.no_grad()
def continuation_logprobs(model, cache: KeptCache, last_token: int, continuations: list[list[int]]) -> list[float]:
    """Sum of log-probabilities of each continuation after the prompt, through a one-row cache (one batch; one
    forward of the last prompt token when every continuation is a single token)."""
    if max(len(c) for c in continuations) == 1:
        logprobs = next_token_logprobs(model, cache, last_token)[0]
        return [float(logprobs[c[0]]) for c in continuations]
    longest = max(len(c) for c in continuations)
    rows = [[last_token] + c[:-1] + [0] * (longest - len(c)) for c in continuations]
    logprobs = _decode(model, cache, torch.tensor(rows, device=input_device(model)), commit=False).float().log_softmax(-1)
    return [float(logprobs[row, torch.arange(len(c)), torch.tensor(c)].sum()) for row, c in enumerate(continuations)]


@torch.no_grad()
def greedy_generate(model, cache: KeptCache, last_token: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding, one sequence per cache row; the cache grows by one position per generated token."""
    device = input_device(model)
    tokens = torch.full((cache.rows, 1), last_token, device=device)
    generated = []
    for _ in range(max_new_tokens):
        logits = _decode(model, cache, tokens, commit=True)
        cache.next_position += 1
        tokens = logits[:, -1].argmax(dim=-1, keepdim=True)
        generated.append(tokens)
    return torch.cat(generated, dim=1).tolist()
