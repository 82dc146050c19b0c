"""`prunetool heal` under a launcher: 2 CPU ranks (gloo) against one process on the same global batch, a
killed and resumed distributed run, and the refusals a launch adds. Real launches: accelerate and torchrun."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.memory import checkpoint_bytes
from prunetool.repair.distributed import rank_share
from test_heal import prune_tiny, tensors
from test_prune_cli import assert_refused

runner = CliRunner()
HEAL = ["--tokens", str(16 * 24), "--seq-len", "24", "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-3"]
LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch_command(launcher: str, ranks: int) -> list[str]:
    if launcher == "accelerate":  # no GPU here: --multi_gpu starts torchrun ranks, heal picks gloo on the CPU
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", free_port(), "-m", "prunetool"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            free_port(), "-m", "prunetool"]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own, so killpg misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def child_env(cache) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return env | {"PRUNETOOL_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def heal_launched(launcher: str, ranks: int, args: list[str], cache) -> dict:
    done = subprocess.run(launch_command(launcher, ranks) + ["heal", *args, "--json"], capture_output=True,
                          text=True, env=child_env(cache), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # only the main rank prints
    return json.loads(lines[0])


def heal_in_process(args: list[str]) -> dict:
    result = runner.invoke(app, ["heal", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_rank_share_splits_the_global_batch_into_equal_micro_batches():
    assert rank_share(4, 1, 2) == (2, 2)  # one process: --batch-size x --grad-accum, as before
    assert rank_share(4, 2, 2) == (2, 1)
    assert rank_share(8, 2, 4) == (4, 1)
    assert rank_share(12, 2, 4) == (3, 2)  # a share of 6 in micro-batches of at most 4: two of 3
    assert rank_share(6, 3, 4) == (2, 1)
    with pytest.raises(Exception, match="cannot split the global batch of 6"):
        rank_share(6, 4, 2)


@pytest.mark.parametrize("train,launcher", [("adjacent", "accelerate"), ("lora", "torchrun"), ("all", "torchrun")])
def test_two_ranks_match_one_process_on_the_same_global_batch(train, launcher, tiny_checkpoint, calib_file, tmp_path,
                                                             _session_cache_dir):
    pruned = prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")
    args = [str(pruned), "--train", train, *HEAL]
    one = heal_in_process(args + ["--output-dir", str(tmp_path / "one")])
    two = heal_launched(launcher, 2, args + ["--output-dir", str(tmp_path / "two")], _session_cache_dir)
    assert two["heal"]["world_size"] == 2 and one["heal"]["world_size"] == 1
    assert two["heal"]["micro_batches_per_rank"] == 1 and two["heal"]["steps"] == one["heal"]["steps"] == 4
    for record in (one, two):  # the main rank's high-water mark when training ended: at least its two models
        peak = record["heal"]["training_peak"]
        assert peak["measure"] == "peak resident set of the process" and peak["bytes"] > checkpoint_bytes(pruned)
    first, last = one["heal"]["loss_summary"], two["heal"]["loss_summary"]
    assert last["last"] == pytest.approx(first["last"], rel=1e-3)
    assert last["first"] == pytest.approx(first["first"], rel=1e-6)  # step 1 sees the same weights and windows
    a, b = tensors(tmp_path / "one"), tensors(tmp_path / "two")
    assert a.keys() == b.keys()
    changed = [name for name in one["heal"]["tensors"]]
    assert changed and set(changed) == set(two["heal"]["tensors"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    before, after = tensors(pruned), a
    assert any(not torch.equal(before[name], after[name]) for name in changed)  # training moved the weights
    assert two["heal"]["perplexity"]["after"] == pytest.approx(one["heal"]["perplexity"]["after"], rel=5e-3)
    assert two["verification"] is not None


def test_a_killed_distributed_run_resumes_to_the_uninterrupted_result(tiny_checkpoint, calib_file, tmp_path,
                                                                      _session_cache_dir):
    pruned = prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")
    args = [str(pruned), "--train", "adjacent", "--tokens", str(64 * 2 * 24), "--seq-len", "24", "--batch-size",
            "2", "--lr", "1e-3", "--save-every", "4", "--epochs", "10"]
    whole = heal_launched("torchrun", 2, args + ["--output-dir", str(tmp_path / "whole")], _session_cache_dir)
    out, state = tmp_path / "resumed", tmp_path / "resumed.checkpoint" / "state.pt"
    command = launch_command("torchrun", 2) + ["heal", *args, "--output-dir", str(out)]
    process = subprocess.Popen(command, env=child_env(_session_cache_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not state.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [process.pid, *descendants(process.pid)]:  # the launcher and every rank (own sessions), mid-run
        os.kill(pid, signal.SIGKILL)
    process.wait()
    assert state.exists() and not out.exists()  # killed after a checkpoint, before anything was published
    resumed = heal_launched("torchrun", 2, args + ["--output-dir", str(out), "--resume"], _session_cache_dir)
    assert resumed["heal"]["resumed_from_step"] >= 4
    assert resumed["heal"]["loss_summary"]["last"] == whole["heal"]["loss_summary"]["last"]
    first, second = tensors(tmp_path / "whole"), tensors(out)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not state.parent.exists()  # the checkpoint goes once the healed folder is published


@pytest.mark.parametrize("env,args,words", [
    ({"WORLD_SIZE": "3"}, [], ["3 ranks cannot split the global batch of 4"]),
    ({"WORLD_SIZE": "2"}, ["--device-map", "auto"], ["--device-map", "distributed launch of 2 ranks"]),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, ["--device-map", "auto", "--offload-dir", "OFFLOAD"],
     ["FSDP config shards the student", "offloaded to disk"]),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, ["--save-every", "2"], ["under FSDP"]),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, [], ["DeepSpeed only on GPUs"]),
    ({}, ["--report-to", "mlflow"], ["--report-to must be one of tensorboard, wandb"]),
])
def test_launch_refusals_are_one_line_and_write_nothing(env, args, words, pruned_llama, tmp_path, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [a.replace("OFFLOAD", str(tmp_path / "offload")) for a in args]
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", str(pruned_llama), *HEAL, "--output-dir", str(out), *args])
    assert_refused(result, *words)
    assert not out.exists() and not (tmp_path / "offload").exists()


def test_report_to_a_tracker_that_is_not_installed_is_refused(pruned_llama, tmp_path):
    from accelerate.utils import is_wandb_available

    if is_wandb_available():
        pytest.skip("wandb is installed here")
    result = runner.invoke(app, ["heal", str(pruned_llama), *HEAL, "--output-dir", str(tmp_path / "h"),
                                 "--report-to", "wandb"])
    assert_refused(result, "wandb package is not installed")


def test_report_to_tensorboard_logs_every_step(pruned_llama, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "healed"
    heal_in_process([str(pruned_llama), *HEAL, "--output-dir", str(out), "--report-to", "tensorboard"])
    events = [path.parent for path in tmp_path.rglob("events.out.tfevents.*")]
    assert events and not any(out in path.parents for path in events)  # logs never land in the healed folder
    accumulator = EventAccumulator(str(events[0])).Reload()
    assert [event.step for event in accumulator.Scalars("loss")] == [1, 2, 3, 4]


@pytest.fixture
def pruned_llama(tiny_checkpoint, calib_file, tmp_path):
    return prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")


@pytest.fixture
def calib_file(tmp_path):
    from test_heal import prose

    path = tmp_path / "calib.txt"
    path.write_text(prose(3000))
    return path


CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"


def launcher_env(config: Path, ranks: int) -> dict:
    """The environment `accelerate launch --config_file CONFIG --num_processes N` gives each rank (accelerate's
    own parsing and env preparation, without starting anything)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", str(ranks), "-m",
                                               "prunetool", "heal"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config) if defaults else []
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name,sharded,extra", [
    ("ddp", None, {}),
    ("fsdp2", "FSDP", {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}),
    ("zero3", "DeepSpeed", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}),
])
def test_each_shipped_accelerate_config_launches_what_heal_reads(name, sharded, extra, monkeypatch):
    from prunetool.repair.distributed import sharded_launch

    env = launcher_env(CONFIGS / f"{name}.yaml", 8)
    assert env.get("ACCELERATE_MIXED_PRECISION", "no") == "no"  # heal sets bf16 autocast itself (--dtype)
    for key, value in extra.items():
        assert env.get(key) == value, (key, env.get(key))
    for key in LAUNCH_ENV[3:]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    assert sharded_launch() == sharded
    assert sorted(path.stem for path in CONFIGS.glob("*.yaml")) == ["ddp", "fsdp2", "zero3"]
