"""Where a heal step's time goes, and what bfloat16 autocast and the fused KL buy (issue 13: heal throughput).

SmolLM2-135M as teacher; the student is the same model with layers 13-18 removed in memory, LoRA r=8 on
every projection, as `prunetool heal --train lora` builds it. One step = one micro-batch of B x 256 random
token windows (timing does not depend on the text): the teacher's forward (no grad), the student's forward,
the loss, the backward and the AdamW step, each timed with perf_counter after warm-up steps. Modes:

- float32: what `heal --dtype float32` (the CPU default) runs;
- bf16 autocast: `heal --dtype bfloat16` (teacher in bfloat16, student weights float32, matmuls bf16);
- the loss alone on the same logits: prunetool's fused form (soft-target cross-entropy minus the teacher's
  entropy) against log_softmax + kl_div, forward and backward.

Run on an otherwise idle machine:   nice .venv/bin/python bench/heal_step.py
Writes bench/results/heal_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
REMOVED = tuple(range(13, 19))
PARTS = ("teacher", "student", "loss", "backward_and_step")


def table(results: dict) -> str:
    lines = [f"{results['setting']['model']} -> layers {results['setting']['removed'][0]}-"
             f"{results['setting']['removed'][-1]} removed, LoRA r=8; {results['setting']['batch']} x "
             f"{results['setting']['seq_len']} tokens per step; median of {results['setting']['steps']} steps "
             f"after {results['setting']['warmup']} warm-up, {results['setting']['threads']} threads.", "",
             "| mode | teacher fwd | student fwd | loss | backward + step | tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for mode, row in results["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{row[part]:.2f} s" for part in PARTS)
                     + f" | {row['tokens_per_second']:.0f} |")
    loss = results["loss"]
    lines += ["", f"The loss alone on {loss['tokens']} tokens x {loss['vocab']} logits, forward + backward: fused "
              f"soft-target form {loss['fused_seconds']:.2f} s, log_softmax + kl_div {loss['kl_div_seconds']:.2f} s "
              f"({loss['kl_div_seconds'] / loss['fused_seconds']:.1f}x)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from prunetool.commands.heal import LORA_ALPHA_PER_RANK, lora_targets
    from prunetool.in_memory import prune_in_memory
    from prunetool.loading import load_model
    from prunetool.repair.distill import distill_loss, kl_loss
    from prunetool.sources import resolve_model
    from provenance import write_results
    from peft import LoraConfig, get_peft_model

    source = resolve_model(args.model)
    results = {"setting": {"model": args.model, "removed": list(REMOVED), "batch": args.batch,
                           "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                           "threads": torch.get_num_threads()}, "modes": {}}
    for mode, teacher_dtype, autocast in (("float32", "float32", False), ("bf16 autocast", "bfloat16", True)):
        teacher, _ = load_model(source, dtype=teacher_dtype, device="cpu")
        student, _ = load_model(source, dtype="float32", device="cpu")
        prune_in_memory(student, REMOVED)
        student.requires_grad_(False)
        student = get_peft_model(student, LoraConfig(r=8, lora_alpha=8 * LORA_ALPHA_PER_RANK,
                                                     target_modules=lora_targets(student)))
        optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
        vocab = teacher.config.vocab_size
        times = {part: [] for part in PARTS}
        generator = torch.Generator().manual_seed(0)
        for step in range(args.warmup + args.steps):
            batch = torch.randint(vocab, (args.batch, args.seq_len), generator=generator)
            marks = [time.perf_counter()]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=batch, use_cache=False).logits
                marks.append(time.perf_counter())
                student_logits = student(input_ids=batch, use_cache=False).logits
            marks.append(time.perf_counter())
            loss = distill_loss(student_logits, teacher_logits, batch)
            marks.append(time.perf_counter())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            marks.append(time.perf_counter())
            if step >= args.warmup:
                for part, start, end in zip(PARTS, marks, marks[1:]):
                    times[part].append(end - start)
        row = {part: statistics.median(values) for part, values in times.items()}
        row["tokens_per_second"] = args.batch * args.seq_len / sum(row[part] for part in PARTS)
        results["modes"][mode] = row
        print(mode, row, file=sys.stderr)
        del teacher, student, optimizer

    def kl_div_reference(student_logits, teacher_logits):
        student_log = F.log_softmax(student_logits.float(), dim=-1)
        teacher_log = F.log_softmax(teacher_logits.float(), dim=-1)
        return F.kl_div(student_log, teacher_log, reduction="none", log_target=True).sum(-1).mean()

    tokens = args.batch * (args.seq_len - 1)
    generator = torch.Generator().manual_seed(1)
    student_logits = torch.randn(tokens, vocab, generator=generator)
    teacher_logits = torch.randn(tokens, vocab, generator=generator)
    seconds = {}
    for name, function in (("fused", kl_loss), ("kl_div", kl_div_reference)):
        runs = []
        for _ in range(args.warmup + args.steps):
            logits = student_logits.clone().requires_grad_(True)
            start = time.perf_counter()
            function(logits, teacher_logits).backward()
            runs.append(time.perf_counter() - start)
        seconds[name] = statistics.median(runs[args.warmup:])
    results["loss"] = {"tokens": tokens, "vocab": vocab, "fused_seconds": seconds["fused"],
                       "kl_div_seconds": seconds["kl_div"]}
    write_results("heal_step", results)


if __name__ == "__main__":
    main()
