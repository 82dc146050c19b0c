"""The model card's "Serve" lines run as written: the vLLM snippet in vLLM, and the llama.cpp lines (export, then
llama-completion), on a block folder and a nemotron-nas folder that `prunetool prune` wrote."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prunetool.checkpoint.exports import FOLDER_PLACEHOLDER, PROMPT
from prunetool.cli import app
from test_cli import PROSE

pytestmark = pytest.mark.engines
# What a shared 2-core CPU machine needs beyond the card's snippet: vLLM's CPU backend reserves
# gpu_memory_utilization (default 0.92) of the machine's memory and refuses to start when less is free,
# and one process instead of three saves a vLLM import per extra process.
CPU_MACHINE = ("import functools, vllm; vllm.LLM = functools.partial(vllm.LLM, gpu_memory_utilization=0.1, "
               "distributed_executor_backend='uni', enforce_eager=True, max_model_len=512)\n")
RELEASE = ("from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel\n"
           "destroy_model_parallel(); destroy_distributed_environment(); import gc; gc.collect()\n")


def card_blocks(folder: Path, language: str) -> str:
    card = (folder / "README.md").read_text()
    serve = card[card.index("## Serve"):]
    return re.search(rf"```{language}\n(.*?)```", serve, re.S).group(1).replace(FOLDER_PLACEHOLDER, str(folder))


@pytest.fixture(scope="module")
def pruned(engine_folder, tmp_path_factory):
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text(PROSE * 3)
    folders = {}
    for unit in ("block", "attention"):
        out = tmp_path_factory.mktemp("card") / unit
        result = CliRunner().invoke(app, ["prune", str(engine_folder("llama-base")), "--unit", unit, "--remove-layers",
                                          "1,3", "--calib", str(calib), "--seq-len", "32", "--samples", "2",
                                          "--output-dir", str(out)])
        assert result.exit_code == 0, result.output
        folders[unit] = out
    return folders


def test_card_python_snippets_run_in_vllm(pruned, vllm_engine):
    """Both cards' snippets, one after the other in one vLLM process (each start-up imports vLLM for a minute)."""
    snippets = {unit: card_blocks(folder, "python") for unit, folder in pruned.items()}
    assert "trust_remote_code=True" in snippets["attention"] and "trust_remote_code" not in snippets["block"]
    program = CPU_MACHINE + "".join(
        f"print('<{unit}>')\nexec({snippet!r}, {{}})\nprint('</{unit}>')\n{RELEASE}" for unit, snippet in snippets.items())
    done = subprocess.run([str(vllm_engine), "-c", program], capture_output=True, text=True,
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PATH": "/usr/bin:/bin"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for unit in snippets:  # each printed a completion
        assert re.search(rf"<{unit}>\n.*\S.*\n</{unit}>", done.stdout, re.S), done.stdout


@pytest.mark.parametrize("unit", ["block", "attention"])
def test_card_llamacpp_lines_run(unit, pruned, llamacpp_engine, tmp_path):
    lines = [line.split("  #")[0] for line in card_blocks(pruned[unit], "bash").splitlines() if line.strip()]
    vllm_line, export_line, completion_line = lines
    assert vllm_line.startswith("vllm serve") and ("--trust-remote-code" in vllm_line) == (unit != "block")
    export = shlex.split(export_line)
    assert export[0] == "prunetool"
    done = subprocess.run([sys.executable, "-m", "prunetool", *export[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    completion = shlex.split(completion_line)
    assert completion[0] == "llama-completion" and PROMPT in completion
    done = subprocess.run([str(llamacpp_engine.tool("llama-completion")), *completion[1:], "--temp", "0"],
                          cwd=tmp_path, capture_output=True, text=True, errors="replace", timeout=300,
                          stdin=subprocess.DEVNULL)  # a random tiny model's bytes need not be UTF-8
    assert done.returncode == 0, done.stderr[-3000:]
    assert PROMPT in done.stdout
