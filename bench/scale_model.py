"""A memory and time model of each command on Llama-3.1-8B and 70B, checked against what was measured here.

Nothing is run on the big models: their sizes are their published configs (Llama 3.1 model card and
config.json: 8B has 32 layers of width 4096, MLP 14336, 32 query and 8 KV heads, a 128256-token
vocabulary and untied embeddings; 70B has 80 layers of width 8192, MLP 28672, 64 query and 8 KV heads).
The model counts what each command holds at its peak and how many layer-token forwards it runs:

- weights: parameters x 2 bytes (bfloat16); heal's student trains in float32 (4 bytes) beside a bf16 teacher;
- activations: the hidden states a command keeps (windows x tokens x width), one batch's logits
  (batch x tokens x vocabulary, float32, with lm-eval's log-softmax beside them), the patch fit's two
  d x d float64 accumulators per removed run;
- time: 2 x parameters FLOPs per token forward (6 x for a training step), at an assumed achieved rate
  (--tflops, default 300 TFLOP/s: about 40% of an H100's bf16 peak; small batches reach less).

Heal on several GPUs (`heal_ranks`): per-GPU bytes of one rank for LoRA (r=8 on every projection) and all
weights, on 1 GPU and on 8 under DDP, FSDP2 and ZeRO-3 as configs/accelerate/ ships them:

- teacher 2 bytes/parameter, sharded under FSDP2 (heal prepares it like the student), a replica otherwise;
- float32 student (the pruned model: a quarter of the layers removed) 4 bytes/parameter, sharded under
  FSDP2 and ZeRO-3 plus two gathered layers (the one running and the one prefetched);
- trainable parameters t (LoRA: r x (in + out) per projection; all: the student): float32 gradients 4t and
  AdamW's two moments 8t, sharded under FSDP2 and ZeRO-3; DDP adds its 4t of gradient buckets;
- activations of one rank's micro-batch (heal's default 4 x 256 tokens) as in the one-GPU heal row.

The check: the same formulas for Gemma 3 270M against bench/results/score_memory.json (peak RSS of score,
default and --low-memory), the heal formulas for SmolLM2 on the CPU (float32 teacher, one process and each
of 2 DDP ranks) against bench/results/heal_distributed.json's peak RSS, and for SmolLM2 against the halving search's measured time
(bench/results/dry_run_time.json) with the CPU rate that bench/results/cut_engine_speed.json implies.

Run:   .venv/bin/python bench/scale_model.py
Writes bench/results/scale_model.json; `table` and `check_table` render it for docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from provenance import write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GIB = 1024 ** 3

# Published configs (Llama 3.1 config.json files on the Hugging Face Hub, meta-llama/Llama-3.1-{8B,70B}).
LLAMA = {
    "Llama-3.1-8B": dict(layers=32, d=4096, ff=14336, heads=32, kv=8, head_dim=128, vocab=128256, tied=False),
    "Llama-3.1-70B": dict(layers=80, d=8192, ff=28672, heads=64, kv=8, head_dim=128, vocab=128256, tied=False),
}
# The defaults of the commands (prunetool/select/ranking.py, cli.py): 16 x 512 calibration windows for score;
# halving on 4 measuring windows of 512 tokens screened on their first 128; heal 100k tokens in 4 x 256.
SCORE_WINDOWS, SEQ = 16, 512
REFINE, SCREEN, KEEP, BLOCKS = 4, 128, 4, 3
HEAL_TOKENS, HEAL_BATCH, HEAL_SEQ = 100_000, 4, 256
EVAL_BATCH, EVAL_LEN = 8, 2048


def layer_params(c: dict) -> int:
    attention = c["d"] * c["heads"] * c["head_dim"] * 2 + c["d"] * c["kv"] * c["head_dim"] * 2
    return attention + 3 * c["d"] * c["ff"] + 2 * c["d"]


def model_params(c: dict) -> int:
    embeddings = c["vocab"] * c["d"] * (1 if c["tied"] else 2)
    return c["layers"] * layer_params(c) + embeddings + c["d"]


LORA_RANK = 8
LAUNCHES = {"1 GPU": (1, None), "DDP x 8": (8, "ddp"), "FSDP2 x 8": (8, "fsdp2"), "ZeRO-3 x 8": (8, "zero3")}


def lora_params(c: dict, layers: int, rank: int = LORA_RANK) -> int:
    """LoRA's A and B for q, k, v, o, gate, up and down: r x (in + out) each."""
    q, kv = c["heads"] * c["head_dim"], c["kv"] * c["head_dim"]
    shapes = [(c["d"], q), (c["d"], kv), (c["d"], kv), (q, c["d"]), (c["d"], c["ff"]), (c["d"], c["ff"]), (c["ff"], c["d"])]
    return layers * rank * sum(i + o for i, o in shapes)


def heal_rank_bytes(c: dict, *, student_layers: int, train: str, ranks: int, launch: str | None,
                    micro_batch: int, seq: int, teacher_bytes: int = 2, activation_bytes: int = 2) -> dict:
    """What one rank of heal holds at its peak, by part (bytes)."""
    n = model_params(c)
    student = model_params(c | {"layers": student_layers})
    trainable = lora_params(c, student_layers) if train == "lora" else student
    sharded = launch in ("fsdp2", "zero3")
    gathered = 2 * 4 * layer_params(c)  # the layer running and the one prefetched, float32
    parts = {
        "teacher": teacher_bytes * n / (ranks if launch == "fsdp2" else 1)
                   + (2 * teacher_bytes * layer_params(c) if launch == "fsdp2" else 0),
        "student": 4 * student / ranks + gathered if sharded else 4 * student,
        "gradients and AdamW": 12 * trainable / ranks if sharded else 12 * trainable,
        "DDP buckets": 4 * trainable if launch == "ddp" else 0,
        "activations and logits": micro_batch * seq * student_layers * (10 * c["d"] + 3 * c["ff"]) * activation_bytes
                                  + 3 * 4 * micro_batch * seq * c["vocab"],
    }
    if train == "lora" and sharded:
        parts["student"] = 4 * (student - trainable) / ranks + gathered + 4 * trainable / ranks
    parts["total"] = sum(parts.values())
    return parts


def heal_ranks(c: dict, drop: int) -> list[dict]:
    rows = []
    for train in ("lora", "all"):
        for label, (ranks, launch) in LAUNCHES.items():
            parts = heal_rank_bytes(c, student_layers=c["layers"] - drop, train=train, ranks=ranks, launch=launch,
                                    micro_batch=HEAL_BATCH, seq=HEAL_SEQ)
            rows.append({"train": train, "launch": label, "ranks": ranks, "bytes": parts})
    return rows


def halving_layer_tokens(c: dict, drop: int) -> tuple[float, float]:
    """Layer-token forwards of the default search and lm_head tokens (the logits of every measurement):
    round one screens every layer, later rounds half of them, each on REFINE x SCREEN tokens; each round
    confirms KEEP on REFINE x SEQ; then BLOCKS blocks and 4 swap tries per removed layer. A candidate
    runs from its first removed layer on: half the depth on average."""
    layers = c["layers"]
    screens = layers + (drop - 1) * max(layers // 2, KEEP + drop) + 2 * BLOCKS
    confirms = drop * KEEP + BLOCKS + 4 * drop
    depth = layers / 2
    screen_tokens, confirm_tokens = screens * REFINE * SCREEN, confirms * REFINE * SEQ
    return (screen_tokens + confirm_tokens) * depth, screen_tokens + confirm_tokens


def commands(c: dict, drop: int, tflops: float) -> list[dict]:
    """Peak bytes and seconds for each command on one device holding the whole model."""
    n, per_layer = model_params(c), layer_params(c)
    weights = 2 * n
    hidden = lambda windows, tokens: 2 * windows * tokens * c["d"]  # bf16 hidden states
    rate = tflops * 1e12
    forward = lambda tokens: 2 * n * tokens / rate
    layer_tokens, head_tokens = halving_layer_tokens(c, drop)
    search_flops = 2 * per_layer * layer_tokens + 2 * c["vocab"] * c["d"] * head_tokens
    heal_steps = math.ceil(HEAL_TOKENS / (HEAL_BATCH * HEAL_SEQ))
    heal_tokens = heal_steps * HEAL_BATCH * HEAL_SEQ
    rows = [
        {"command": "score", "what": "weights + one window's activations",
         "bytes": weights + 4 * SEQ * (6 * c["d"] + 2 * c["ff"]), "seconds": forward(SCORE_WINDOWS * SEQ)},
        {"command": "score --low-memory", "what": "one layer + the embedding rows the windows use + every window's hidden states (in and out)",
         "bytes": 2 * per_layer + 2 * SCORE_WINDOWS * SEQ * c["d"] + 2 * hidden(SCORE_WINDOWS, SEQ),
         "seconds": forward(SCORE_WINDOWS * SEQ)},
        {"command": f"prune --drop {drop} (halving)", "what": "weights + hidden states at every layer boundary + one window's logits",
         "bytes": weights + (c["layers"] + 1) * hidden(REFINE, SEQ) + 4 * SEQ * c["vocab"],
         "seconds": search_flops / rate},
        {"command": "prune --patch (fit)", "what": "two d x d float64 accumulators per removed run (down_proj mode: d_ff x d_ff)",
         "bytes": 2 * 8 * c["d"] ** 2, "bytes_down_proj": 2 * 8 * c["ff"] ** 2, "seconds": forward(128 * SEQ)},
        {"command": "heal (LoRA, 100k tokens)", "what": "float32 student + bf16 teacher + activations kept for backward + logits",
         "bytes": 4 * n + weights + HEAL_BATCH * HEAL_SEQ * c["layers"] * (10 * c["d"] + 3 * c["ff"]) * 2
                  + 3 * 4 * HEAL_BATCH * HEAL_SEQ * c["vocab"],
         "seconds": (6 * n + 2 * n) * heal_tokens / rate},
        {"command": "eval (hf, batch 8 x 2048)", "what": "weights + float32 logits and their log-softmax",
         "bytes": weights + 8 * EVAL_BATCH * EVAL_LEN * c["vocab"], "seconds": None},
    ]
    return rows


def gemma_check() -> dict:
    """score's peak on Gemma 3 270M from the same terms (float32, as measured) against the measured RSS."""
    config = json.loads((Path.home() / ".cache" / "prunetool" / "models" / "gemma3-270m" / "config.json").read_text())
    c = dict(layers=config["num_hidden_layers"], d=config["hidden_size"], ff=config["intermediate_size"],
             heads=config["num_attention_heads"], kv=config["num_key_value_heads"], head_dim=config["head_dim"],
             vocab=config["vocab_size"], tied=True)
    measured = json.loads((RESULTS / "score_memory.json").read_text())
    n, per_layer = model_params(c), layer_params(c)
    windows, seq = measured["samples"], measured["seq_len"]
    baseline = interpreter_rss()
    predicted = {"default": baseline + 4 * n + 4 * seq * (6 * c["d"] + 2 * c["ff"]),
                 "--low-memory": baseline + 4 * per_layer + 4 * windows * seq * c["d"] + 2 * 4 * windows * seq * c["d"]}
    runs = {run["mode"]: run["peak_rss_bytes"] for run in measured["runs"]}
    return {"model": "gemma3-270m", "params": n, "interpreter_rss": baseline, "predicted_bytes": predicted,
            "measured_peak_rss": runs}


def interpreter_rss() -> int:
    """Peak RSS of a process that only imports what `prunetool score` imports: the part no formula covers."""
    import os
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "import torch, transformers, prunetool.cli, prunetool.select.scoring"])
    _, _, usage = os.wait4(process.pid, 0)
    return usage.ru_maxrss * 1024


def smollm_config() -> dict:
    config = json.loads((Path.home() / ".cache" / "prunetool" / "models" / "smollm2-135m" / "config.json").read_text())
    return dict(layers=config["num_hidden_layers"], d=config["hidden_size"], ff=config["intermediate_size"],
                heads=config["num_attention_heads"], kv=config["num_key_value_heads"],
                head_dim=config["hidden_size"] // config["num_attention_heads"], vocab=config["vocab_size"], tied=True)


def heal_check(baseline: int) -> dict:
    """heal's per-rank formula on SmolLM2 (CPU: float32 teacher and activations) against the measured peaks."""
    measured = json.loads((RESULTS / "heal_distributed.json").read_text())
    setting, c = measured["setting"], smollm_config()
    rows = []
    for train, row in measured["rows"].items():
        for run, ranks, launch, micro in (("one", 1, None, 2), ("two", 2, "ddp", 2)):
            parts = heal_rank_bytes(c, student_layers=c["layers"] - len(setting["removed"]), train=train, ranks=ranks,
                                    launch=launch, micro_batch=micro, seq=setting["seq_len"], teacher_bytes=4,
                                    activation_bytes=4)
            rows.append({"train": train, "run": "1 process" if ranks == 1 else "each of 2 DDP ranks",
                         "predicted_bytes": baseline + parts["total"],
                         "measured_peak_rss": row[run].get("training_peak_rss", row[run]["peak_rss"]),
                         "measured": "training" if "training_peak_rss" in row[run] else "whole command"})
    return {"interpreter_rss": baseline, "rows": rows}


def smollm_check() -> dict:
    """The halving search's forward count on SmolLM2 -6 at the CPU rate measured by the cut engine bench."""
    speed = json.loads((RESULTS / "cut_engine_speed.json").read_text())
    row = next(r for r in speed["rows"] if r["model"] == "smollm2-135m" and not r["cut"])
    setting = speed["setting"]
    c = smollm_config()
    per_layer = layer_params(c)
    # full forwards of every candidate cut: candidates x windows x seq tokens through all kept layers + lm_head
    tokens = row["candidates"] * setting["windows"] * setting["seq_len"]
    flops = tokens * (2 * per_layer * (c["layers"] - 1) + 2 * c["vocab"] * c["d"])
    rate = flops / row["full_seconds"]  # one thread
    layer_tokens, head_tokens = halving_layer_tokens(c, 6)
    predicted = (2 * per_layer * layer_tokens + 2 * c["vocab"] * c["d"] * head_tokens) / (2 * rate)  # two threads
    measured = json.loads((RESULTS / "dry_run_time.json").read_text())
    seconds = next(r["seconds"] for r in measured["rows"] if r["criterion"] == "halving")
    return {"model": "smollm2-135m", "drop": 6, "cpu_flops_per_thread": rate, "predicted_seconds": predicted,
            "measured_seconds": seconds}


def gib(value) -> str:
    return "" if value is None else f"{value / GIB:,.2f} GiB" if value < GIB else f"{value / GIB:,.1f} GiB"


def duration(seconds) -> str:
    if seconds is None:
        return "lm-eval's own"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def table(results: dict) -> str:
    lines = [f"Assumed achieved rate: {results['tflops']:g} TFLOP/s; bfloat16 weights; one device holding what the row says. "
             f"A GPU holds 80 GiB (H100) or 141 GiB (H200); with `--device-map` over 8 GPUs the weights split "
             "eightfold and the activations stay on the device of the layer running.", ""]
    for name, rows in results["models"].items():
        lines += [f"**{name}** ({results['params'][name] / 1e9:.1f}B parameters, prune --drop {results['drops'][name]})", "",
                  "| command | what is held | peak memory | per GPU of 8 | time at the assumed rate |",
                  "|---|---|---:|---:|---:|"]
        for row in rows:
            extra = f" (down_proj: {gib(row['bytes_down_proj'])})" if "bytes_down_proj" in row else ""
            per_gpu = gib(row["bytes"] / 8) if not row["command"].startswith(("score --low", "prune --patch")) else ""
            lines.append(f"| `{row['command']}` | {row['what']} | {gib(row['bytes'])}{extra} | {per_gpu} | {duration(row['seconds'])} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def heal_table(results: dict) -> str:
    """Per-GPU bytes of heal on 8B and 70B by launch, and the check against the CPU runs."""
    parts = ("teacher", "student", "gradients and AdamW", "DDP buckets", "activations and logits")
    lines = ["Per GPU, one rank's peak; student = the model with a quarter of its layers removed; micro-batch 4 x 256 "
             "tokens per rank; bfloat16 teacher and activations, float32 student.", ""]
    for name, rows in results["heal_ranks"].items():
        lines += [f"**{name}**", "", "| train | launch | " + " | ".join(parts) + " | per GPU | fits 80 GiB |",
                  "|---|---|" + "---:|" * (len(parts) + 1) + "---|"]
        for row in rows:
            b = row["bytes"]
            lines.append(f"| {row['train']} | {row['launch']} | " + " | ".join(gib(b[p]) if b[p] else "" for p in parts)
                         + f" | **{gib(b['total'])}** | {'yes' if b['total'] <= 80 * GIB else 'no'} |")
        lines.append("")
    check = results["check"].get("heal")
    if check:
        lines += [f"The same formula against heal on SmolLM2 on this CPU (float32 teacher and activations, micro-batch "
                  f"2 x 256; prediction + {gib(check['interpreter_rss'])} for the imports; `bench/heal_distributed.py`):", "",
                  "| train | run | predicted peak | measured peak RSS |", "|---|---|---:|---:|"]
        lines += [f"| {r['train']} | {r['run']} | {gib(r['predicted_bytes'])} | {gib(r['measured_peak_rss'])} "
                  f"({r['measured']}) |"
                  for r in check["rows"]]
    return "\n".join(lines).rstrip()


def check_table(results: dict) -> str:
    g, s = results["check"]["gemma"], results["check"]["smollm"]
    lines = ["| check | predicted | measured here |", "|---|---:|---:|"]
    for mode in ("default", "--low-memory"):
        lines.append(f"| Gemma 3 270M `score` {mode}, float32: peak RSS (prediction + {gib(g['interpreter_rss'])} "
                     f"for the imports) | {gib(g['predicted_bytes'][mode])} | {gib(g['measured_peak_rss'][mode])} |")
    lines.append(f"| SmolLM2 `prune --drop 6 --dry-run` (halving), 2 threads | {s['predicted_seconds']:.0f} s | "
                 f"{s['measured_seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tflops", type=float, default=300.0)
    args = parser.parse_args()
    drops = {name: c["layers"] // 4 for name, c in LLAMA.items()}
    results = {"tflops": args.tflops, "drops": drops,
               "params": {name: model_params(c) for name, c in LLAMA.items()},
               "models": {name: commands(c, drops[name], args.tflops) for name, c in LLAMA.items()},
               "heal_ranks": {name: heal_ranks(c, drops[name]) for name, c in LLAMA.items()},
               "check": {"gemma": gemma_check(), "smollm": smollm_check()}}
    if (RESULTS / "heal_distributed.json").exists():
        results["check"]["heal"] = heal_check(results["check"]["gemma"]["interpreter_rss"])
    write_results("scale_model", results)
    print(table(results))
    print()
    print(check_table(results))
    print()
    print(heal_table(results))


if __name__ == "__main__":
    main()
