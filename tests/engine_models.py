"""Pruned folders of every kind prune writes, built once per test session for the serving-engine tests.

The tiny models have the proportions of real checkpoints, which the engines assume: head_dim 64 = hidden / heads
(vLLM's Qwen2 derives it so), and an MLP width that is a multiple of 256, so nemotron-nas folders carry
`ffn_mult` as real ones do. Block cuts go through the same writer as
`prunetool prune`, sublayer cuts through the nemotron-nas writer; the real SmolLM2 cuts are the ones the
serving notes measured (layers 13-18).

    folder = engine_folder("llama-attention")   # a name from FOLDERS or MORE_FOLDERS, or "<arch>-base"
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config, SiglipVisionConfig)

from prunetool.checkpoint.surgery import write_nemotron_checkpoint, write_pruned_checkpoint
from prunetool.select.plan import PrunePlan
from tiny_models import SPECIAL_TOKENS, make_tokenizer

LAYERS = 6
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, initializer_range=0.05)


def gemma3_text(common: dict, query_pre_attn_scalar: int = 64) -> Gemma3TextConfig:
    """Two sliding layers, then a full one; the window is shorter than the test prompts."""
    return Gemma3TextConfig(**common, sliding_window=16, query_pre_attn_scalar=query_pre_attn_scalar,
                            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                         for i in range(LAYERS)])


def gemma3_wrapper(common: dict) -> Gemma3Config:
    """Gemma3ForConditionalGeneration: the same text decoder under model.language_model, a 1-layer SigLIP tower."""
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_use_head=False)
    return Gemma3Config(text_config=gemma3_text(common), vision_config=vision, mm_tokens_per_image=4,
                        boi_token_index=SPECIAL_TOKENS.index("<start_of_image>"),
                        eoi_token_index=SPECIAL_TOKENS.index("<end_of_image>"),
                        image_token_index=SPECIAL_TOKENS.index("<image_soft_token>"), initializer_range=0.05)


TINY = {
    "llama": lambda common: LlamaConfig(**common),
    "qwen2": lambda common: Qwen2Config(**common, use_sliding_window=False),
    "gemma3": gemma3_text,
}
# name -> (base, what goes): ("block", layers) or ("sublayers", removed attention, removed MLP)
FOLDERS = {
    "llama-block": ("llama", ("block", (1, 4))),
    "qwen2-block": ("qwen2", ("block", (2, 3))),
    "gemma3-block": ("gemma3", ("block", (1, 3))),  # the full-attention layer 2 moves to index 1
    "llama-attention": ("llama", ("sublayers", (1, 3, 4), ())),
    "llama-mlp": ("llama", ("sublayers", (), (1, 2, 5))),  # the last layer's MLP too
    "llama-mixed": ("llama", ("sublayers", (2, 3, 5), (3, 4))),  # layer 3 loses both
    "qwen2-attention": ("qwen2", ("sublayers", (2, 4), ())),
    "qwen2-mlp": ("qwen2", ("sublayers", (), (0, 3))),
    "qwen2-mixed": ("qwen2", ("sublayers", (1, 4), (1, 2))),
}


def qwen2_heads(head_dim: int):
    return lambda common: Qwen2Config(**(common | dict(head_dim=head_dim)), use_sliding_window=False)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # scales at test lengths
# Block cuts of the other families and settings `prunetool export --gguf` writes, kept apart from FOLDERS so
# that tests running every FOLDERS entry on every engine do not grow. llama.cpp's qwen2 graph loads only
# heads * head_dim == hidden_size (qwen2-fit); qwen2-wide has heads twice as wide. gemma3-qscale scales
# queries by a query_pre_attn_scalar other than head_dim, which llama.cpp's gemma3 graph does not read.
MORE_TINY = {
    "mistral": lambda common: MistralConfig(**common, sliding_window=None),
    "llama3rope": lambda common: LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE)),
    "qwen2-fit": qwen2_heads(SIZES["hidden_size"] // SIZES["num_attention_heads"]),
    "qwen2-wide": qwen2_heads(2 * SIZES["hidden_size"] // SIZES["num_attention_heads"]),
    "qwen3": lambda common: Qwen3Config(**common, use_sliding_window=False),
    "gemma3-qscale": lambda common: gemma3_text(common, query_pre_attn_scalar=32),
    "gemma3mm": gemma3_wrapper,
}
MORE_FOLDERS = {
    "mistral-block": ("mistral", ("block", (0, 5))),
    "llama3rope-block": ("llama3rope", ("block", (2,))),
    "qwen2-fit-block": ("qwen2-fit", ("block", (2, 3))),
    "qwen2-wide-block": ("qwen2-wide", ("block", (2, 3))),
    "qwen3-block": ("qwen3", ("block", (1, 4))),
    "gemma3-qscale-block": ("gemma3-qscale", ("block", (1, 3))),
    "gemma3mm-block": ("gemma3mm", ("block", (1, 3))),
}
SMOLLM2_CUT = tuple(range(13, 19))
REAL_FOLDERS = {"smollm2-block6": ("block", SMOLLM2_CUT), "smollm2-attn6": ("sublayers", SMOLLM2_CUT, ())}


def random_prompts(vocab: int, count: int = 4, seed: int = 0) -> list[list[int]]:
    """Random token prompts longer than Gemma 3's 16-token test window; ids above the special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randrange(20, 40))] for _ in range(count)]


def wikitext_prompts(tokenizer, data: Path, count: int = 8) -> list[list[int]]:
    """The first 300 characters of the first `count` long WikiText-2 lines (the real-model prompts)."""
    lines = [line for line in (data / "wikitext2-test.raw").read_bytes().decode("utf-8").split("\r\n")
             if len(line) > 200][:count]
    return [tokenizer(line[:300])["input_ids"] for line in lines]


def wikitext_prefix(data: Path, out_dir: Path, size: int) -> tuple[Path, str]:
    """The first `size` bytes of WikiText-2 (to a line end), bytes as they are: CRLF kept, as llama-perplexity reads."""
    raw = (data / "wikitext2-test.raw").read_bytes()
    cut = raw[: raw.index(b"\n", size) + 1]
    path = out_dir / f"wikitext-prefix-{size}.raw"
    path.write_bytes(cut)
    return path, cut.decode("utf-8")


def make_base(arch: str, path: Path) -> Path:
    tok = make_tokenizer(path)
    common = SIZES | dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config((TINY | MORE_TINY)[arch](common), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def write_cut(source: Path, cut: tuple, output: Path, num_layers: int) -> Path:
    """The folder prune writes for this cut, without calibration or verification."""
    if cut[0] == "block":
        plan = PrunePlan(base_model=str(source), num_layers=num_layers, removed=cut[1], criterion="manual")
        return write_pruned_checkpoint(source, plan, output)
    return write_nemotron_checkpoint(source, output, removed_attention=cut[1], removed_mlp=cut[2])


@pytest.fixture(scope="session")
def engine_folder(tmp_path_factory):
    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name in built:
            return built[name]
        if name.endswith("-base") and name[:-5] in TINY | MORE_TINY:
            built[name] = make_base(name[:-5], tmp_path_factory.mktemp(name))
        elif name in FOLDERS | MORE_FOLDERS:
            base, cut = (FOLDERS | MORE_FOLDERS)[name]
            built[name] = write_cut(make(f"{base}-base"), cut, tmp_path_factory.mktemp("cuts") / name, LAYERS)
        elif name == "smollm2-base":
            from prunetool.sources import resolve_model
            built[name] = resolve_model("smollm2-135m").path
        elif name in REAL_FOLDERS:
            built[name] = write_cut(make("smollm2-base"), REAL_FOLDERS[name], tmp_path_factory.mktemp("cuts") / name,
                                    30)
        else:
            raise KeyError(name)
        return built[name]

    return make


def _engine_or_skip(found, name: str):
    """The engine, or a skip that says how to set it up; under CI a missing engine fails instead of skipping."""
    import os

    if found is None:
        message = f"{name} is not set up: run `make engines`"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI runs it before the tests)")
        pytest.skip(message)
    return found


@pytest.fixture(scope="session")
def vllm_engine():
    """The vLLM venv's interpreter (engines/setup.sh)."""
    from prunetool.serving.engines import vllm_python

    return _engine_or_skip(vllm_python(), "vLLM")


@pytest.fixture(scope="session")
def llamacpp_engine():
    """The llama.cpp build (engines/setup.sh): tools, shared libraries, Python bindings, converter."""
    from prunetool.serving.engines import llamacpp

    return _engine_or_skip(llamacpp(), "llama.cpp")
