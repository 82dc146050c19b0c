"""Every kind of folder prune writes runs in vLLM (the CPU build `make engines` sets up) and equals transformers.

For each folder, vLLM's greedy continuation of each prompt is replayed through transformers without a cache:
every token vLLM chose must be transformers' argmax (up to a tie within the tolerance), and vLLM's log-probs of
the chosen tokens and of every prompt token must equal transformers'. A cut vLLM cannot run is refused before
anything is written, and the unchecked folder is shown to fail in vLLM, so the refusal stays honest.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_models import FOLDERS, LAYERS, random_prompts, wikitext_prompts
from prunetool.checkpoint.nemotron_nas import convert
from prunetool.checkpoint.surgery import write_nemotron_checkpoint
from prunetool.errors import OptionError
from prunetool.serving.vllm_tokens import agreement, needs_remote_code, transformers_logprobs, vllm_continuations

pytestmark = pytest.mark.engines
# float32 on both sides; vLLM's CPU kernels (oneDNN GEMMs, its own attention) reorder the sums, measured up
# to ~3e-5 on these folders and on SmolLM2 (serving-engines notes: 4e-5)
TOLERANCE = 2e-4
MAX_TOKENS = 12
TINY_FOLDERS = ["llama-base", "qwen2-base", "gemma3-base", *FOLDERS]


def compare(folder, prompts, continuations):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 trust_remote_code=needs_remote_code(folder)).eval()
    return agreement(model, prompts, continuations, tie=TOLERANCE)


@pytest.fixture(scope="module")
def layer0_folders(engine_folder, tmp_path_factory):
    """The layer-0 attention cut, refused by the writer; the same cut with layer 0's whole block; and the refused
    cut written with the rule switched off, to show vLLM really fails on it."""
    base, root = engine_folder("llama-base"), tmp_path_factory.mktemp("layer0")
    with pytest.raises(OptionError, match=r"^vLLM cannot serve this cut: layer 0 keeps its MLP"):
        write_nemotron_checkpoint(base, root / "refused", removed_attention=(0, 2))
    assert not (root / "refused").exists()
    write_nemotron_checkpoint(base, root / "whole", removed_attention=(0, 2), removed_mlp=(0,))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert, "check_engine_rules", lambda *args: None)
        write_nemotron_checkpoint(base, root / "unchecked", removed_attention=(0, 2))
    return {"layer0-whole-block": root / "whole", "layer0-unchecked": root / "unchecked"}


@pytest.fixture(scope="module")
def tiny_answers(engine_folder, layer0_folders, vllm_engine):
    """vLLM's answers for every tiny folder, from one vLLM start-up."""
    folders = {name: engine_folder(name) for name in TINY_FOLDERS} | layer0_folders
    vocab = json.loads((folders["llama-base"] / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab)
    answers = vllm_continuations(list(folders.values()), prompts, max_tokens=MAX_TOKENS, strict=False)
    return {name: (folder, prompts, answers[folder]) for name, folder in folders.items()}


@pytest.mark.parametrize("name", [*TINY_FOLDERS, "layer0-whole-block"])
def test_tiny_folder_in_vllm_equals_transformers(name, tiny_answers):
    folder, prompts, continuations = tiny_answers[name]
    assert not isinstance(continuations, str), continuations
    assert any(len(c.tokens) == MAX_TOKENS for c in continuations)  # not all stopped at once on EOS
    result = compare(folder, prompts, continuations)
    assert result.not_greedy == [] and result.sequences_equal == len(prompts)
    assert result.worst_logprob_gap < TOLERANCE, result


def test_the_refused_layer0_cut_fails_in_vllm_but_runs_in_transformers(tiny_answers):
    folder, prompts, answer = tiny_answers["layer0-unchecked"]
    assert isinstance(answer, str), "vLLM ran the layer-0 attention cut: the refusal may be lifted"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert torch.isfinite(transformers_logprobs(model, prompts[0])).all()


def test_first_layer_rule_covers_leading_empty_layers():
    convert.check_engine_rules(LAYERS, removed_attention=(0, 1), removed_mlp=(0, 1))  # layer 2 runs attention
    with pytest.raises(OptionError, match="layer 1 keeps its MLP"):
        convert.check_engine_rules(LAYERS, removed_attention=(0, 1), removed_mlp=(0,))


@pytest.mark.slow
def test_real_smollm2_cuts_in_vllm_equal_transformers(engine_folder, vllm_engine, shared_data):
    from transformers import AutoTokenizer

    names = ["smollm2-base", "smollm2-block6", "smollm2-attn6"]
    folders = [engine_folder(name) for name in names]
    prompts = wikitext_prompts(AutoTokenizer.from_pretrained(folders[0]), shared_data)
    answers = vllm_continuations(folders, prompts, max_tokens=16, threads=2)
    for name, folder in zip(names, folders):
        result = compare(folder, prompts, answers[folder])
        assert result.not_greedy == [], (name, result)
        assert result.worst_logprob_gap < TOLERANCE, (name, result)
