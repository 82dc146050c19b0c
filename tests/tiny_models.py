"""Tiny random checkpoints of real transformers architectures, written to disk like hub checkpoints.

Every later test loads these folders through the same code path a real model takes
(`from_pretrained`, safetensors, a real `tokenizer.json`), so the features that matter for
layer pruning and scoring have to be present even at toy size: GQA, q_norm (Qwen3, Gemma3),
per-layer sliding/full attention (`layer_types`), Gemma2 softcapping, Gemma3's per-type RoPE
bases, Phi3's fused `qkv_proj` with partial rotary, and the Gemma3 multimodal wrapper whose
decoder sits under a `language_model` prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    SiglipVisionConfig,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3")

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 4096
SLIDING_WINDOW = 8
# Much larger than the default 0.02 so that every layer changes the residual stream visibly and
# query similarities / block influences differ from layer to layer instead of all being ~0.
INIT_STD = 0.2

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
VOCAB_TARGET = 360

# Training text for the BPE merges. Content is irrelevant; it only needs enough English so the
# merges look like a real tokenizer's (common words become single tokens, rare ones split).
_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model reads text one token at a time and
predicts the next token from everything it has seen so far. Each decoder layer mixes information
between positions with attention and then transforms every position with a small feed forward
network. Some layers change the hidden state a lot, while others barely move it at all, and those
are the layers that can often be removed without hurting the model very much.
Once upon a time there was a little village by the sea. The people of the village went fishing every
morning and came back in the evening with baskets full of fish. The children played on the beach,
built castles of sand and watched the ships sail past the old lighthouse on the hill.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Which planet is known as the red planet? Answer: Mars is known as the red planet.
To make a cup of tea, boil some water, put a tea bag in a cup, pour the hot water over it and wait
for three or four minutes. Then remove the bag, add milk or sugar if you like, and enjoy your drink.
Scientists measure the temperature of the ocean at many depths to understand how heat moves around
the planet. Warm water near the surface flows toward the poles, cools down, sinks, and returns along
the bottom of the sea toward the equator over hundreds of years.
In mathematics, a prime number is a whole number greater than one whose only divisors are one and
itself. The first prime numbers are two, three, five, seven, eleven and thirteen. There are
infinitely many primes, a fact that was already known to the ancient Greeks.
She opened the door, looked outside, and saw that it had been snowing all night. The garden was white
and quiet, and the only sound was a bird singing somewhere in the trees behind the house.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
The weather today is sunny with a light breeze from the west. Tomorrow there will be clouds in the
morning and rain in the afternoon, with temperatures between twelve and eighteen degrees.
"""


def make_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the inline corpus, save it into `path` and return it.

    Byte-level means any Unicode text encodes (the 256-symbol ByteLevel alphabet is always in
    the vocabulary), which calibration and lm-eval code paths rely on. A BOS is prepended like
    Llama/Gemma tokenizers do, so code that handles a leading BOS is exercised.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token=None,
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(path)
    return fast


def _common_kwargs(tok: PreTrainedTokenizerFast, num_layers: int) -> dict:
    """Config fields shared by every text decoder: sizes, token ids, init std."""
    return dict(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Two sliding layers then one full one (s, s, f, s, s, f, ...): both kinds in any 3+ layer model."""
    return ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]


def _gemma3_multimodal_config(tok: PreTrainedTokenizerFast, num_layers: int) -> Gemma3Config:
    """Gemma3ForConditionalGeneration with a 1-layer SigLIP tower; image tokens are real vocab entries."""
    text = Gemma3TextConfig(
        **_common_kwargs(tok, num_layers),
        sliding_window=SLIDING_WINDOW,
        layer_types=_gemma3_layer_types(num_layers),
        query_pre_attn_scalar=HEAD_DIM,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,  # 2x2 patches -> avg-pool kernel 1
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        initializer_range=INIT_STD,
    )


def make_config(arch: str, tok: PreTrainedTokenizerFast, num_layers: int = 6):
    """The config for one architecture, with the sliding/full mix that stresses layer pruning."""
    common = _common_kwargs(tok, num_layers)
    half = max(1, num_layers // 2)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    if arch in ("qwen2", "qwen3"):
        cls = Qwen2Config if arch == "qwen2" else Qwen3Config
        # layers >= max_window_layers use the sliding window
        return cls(**common, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=half)
    if arch == "gemma2":
        return Gemma2Config(
            **common, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=HEAD_DIM, attn_implementation="eager"
        )
    if arch == "gemma3_text":
        return Gemma3TextConfig(
            **common,
            sliding_window=SLIDING_WINDOW,
            layer_types=_gemma3_layer_types(num_layers),
            query_pre_attn_scalar=HEAD_DIM,
        )
    if arch == "gemma3":
        return _gemma3_multimodal_config(tok, num_layers)
    if arch == "phi3":
        common.pop("head_dim")  # Phi3 derives it from hidden_size / heads
        return Phi3Config(
            **common,
            original_max_position_embeddings=MAX_POSITIONS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")


def make_tiny_checkpoint(
    arch: str, path: Path, *, num_layers: int = 6, max_shard_size: str | None = None, seed: int = 0
) -> Path:
    """Build a random model of `arch`, save it (safetensors) plus the tokenizer to `path`.

    Weights depend only on (arch, num_layers, seed). `max_shard_size` such as "20KB" gives a
    multi-shard checkpoint with a `model.safetensors.index.json`.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tokenizer(path)
    config = make_config(arch, tok, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path
