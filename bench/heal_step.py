"""Where a heal step's time goes, and what bfloat16 autocast and the fused KL buy (heal throughput).

SmolLM2-135M as teacher; the student is the same model with layers 13-18 removed in memory, LoRA r=8 on
every projection, as `prunetool heal --train lora` builds it. One step = one micro-batch of B x 256 random
token windows (timing does not depend on the text): the teacher's forward (no grad), the student's forward,
the loss, the backward and the AdamW step, each timed with perf_counter after warm-up steps. Modes:

- float32: what `heal --dtype float32` (the CPU default) runs;
- bf16 autocast: `heal --dtype bfloat16` (teacher in bfloat16, student weights float32, matmuls bf16);
- the loss alone on the same logits: prunetool's chunked form (loss and gradient in one pass over chunks
  of rows) against autograd through log_softmax + kl_div, and heal's default mix KL + 0.5 CE fused into
  the same pass against the chunked KL plus autograd cross-entropy (how it was computed before),
  forward and backward, with the peak memory each adds (tracemalloc does not see torch's allocator, so
  peak RSS growth in a fresh subprocess).

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


def kl_div_reference(student_logits, teacher_logits):
    """What the loss was before: autograd through two log_softmax and kl_div (keeps full-size tensors)."""
    import torch.nn.functional as F

    student_log = F.log_softmax(student_logits.float(), dim=-1)
    teacher_log = F.log_softmax(teacher_logits.float(), dim=-1)
    return F.kl_div(student_log, teacher_log, reduction="none", log_target=True).sum(-1).mean()


def mixed_before(student_logits, teacher_logits, targets):
    """The mixed loss before CE was fused: the chunked KL, plus autograd cross-entropy on a float copy."""
    import torch.nn.functional as F

    from prunetool.repair.distill import kl_loss

    ce = F.cross_entropy(student_logits.float(), targets)
    return 0.5 * kl_loss(student_logits, teacher_logits, chunk_elements=2**24) + 0.5 * ce  # its chunk size then


def mixed_fused(student_logits, teacher_logits, targets, chunk_elements=None):
    from prunetool.repair.distill import token_loss

    return token_loss(student_logits, teacher_logits, targets, ce_weight=0.5, chunk_elements=chunk_elements)


LOSSES = ("chunked", "kl_div", "mixed_fused", "mixed_before")  # KL alone both ways; KL + 0.5 CE both ways
CHUNK_SWEEP = (2**18, 2**20, 2**22, 2**24)  # logits elements per chunk, for the fused mix: what sets the CPU's size


def _loss_child(name: str, tokens: int, vocab: int, warmup: int, steps: int, queue, chunk: int | None = None) -> None:
    import statistics

    import torch

    from prunetool.repair.distill import kl_loss

    generator = torch.Generator().manual_seed(1)
    student = torch.randn(tokens, vocab, generator=generator)
    teacher = torch.randn(tokens, vocab, generator=generator)
    targets = torch.randint(vocab, (tokens,), generator=generator)
    function = {"chunked": kl_loss, "kl_div": kl_div_reference,
                "mixed_fused": lambda s, t: mixed_fused(s, t, targets, chunk),
                "mixed_before": lambda s, t: mixed_before(s, t, targets)}[name]
    logits = student.clone().requires_grad_(True)  # the input and its .grad are counted before the loss
    logits.grad = torch.zeros_like(student)
    def high_water() -> int:  # VmHWM belongs to this process's address space (ru_maxrss survives exec)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

    before = high_water()
    runs = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        function(logits, teacher).backward()
        runs.append(time.perf_counter() - start)
    peak = high_water()
    queue.put((statistics.median(runs[warmup:]), peak - before))


def loss_cost(name: str, tokens: int, vocab: int, warmup: int, steps: int, chunk: int | None = None) -> tuple[float, int]:
    """Median seconds of forward + backward, and the peak memory the loss adds, in a fresh process."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_loss_child, args=(name, tokens, vocab, warmup, steps, queue, chunk))
    child.start()
    result = queue.get()
    child.join()
    return result


def table(results: dict) -> str:
    earlier = results.get("steps_measured_by")
    lines = ([f"Step rows measured by `{earlier}` on the same machine; the loss rows by the command above.", ""]
             if earlier else []) + [f"{results['setting']['model']} -> layers {results['setting']['removed'][0]}-"
             f"{results['setting']['removed'][-1]} removed, LoRA r=8; loss "
             f"{'KL + ' + format(results['setting']['ce_weight'], 'g') + ' CE' if results['setting'].get('ce_weight') else 'KL'}"
             f"; {results['setting']['batch']} x "
             f"{results['setting']['seq_len']} tokens per step; median of {results['setting']['steps']} steps "
             f"after {results['setting']['warmup']} warm-up, {results['setting']['threads']} threads.", "",
             "| mode | teacher fwd | student fwd | loss | backward + step | tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for mode, row in results["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{row[part]:.2f} s" for part in PARTS)
                     + f" | {row['tokens_per_second']:.0f} |")
    loss = results["loss"]
    names = [name for name in LOSSES if f"{name}_seconds" in loss]  # results before the mixed rows hold two
    headers = {"chunked": "KL: chunked (prunetool)", "kl_div": "KL: log_softmax + kl_div",
               "mixed_fused": "KL + 0.5 CE: fused (prunetool)", "mixed_before": "KL + 0.5 CE: chunked KL + autograd CE"}
    lines += ["", f"The loss alone on {loss['tokens']} tokens, forward + backward, in float32, and the peak memory it "
              "and its backward add (the logits and a preallocated .grad excluded):", "",
              "| vocabulary | " + " | ".join(headers[name] for name in names) + " |",
              "|---|" + "---:|" * len(names)]
    for label, size in (("", loss["vocab"]), ("_262k", 262_144)):
        cells = [f"{loss[name + label + '_seconds']:.2f} s, {loss[name + label + '_peak_bytes'] / 2**30:.2f} GiB"
                 for name in names]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    if "chunk_sweep_seconds" in loss:
        lines += ["", f"The fused KL + 0.5 CE by chunk size (logits elements handled at once; prunetool uses "
                  f"2^{loss['cpu_chunk_elements'].bit_length() - 1} on the CPU, larger chunks on a GPU):", "",
                  "| vocabulary | " + " | ".join(f"2^{chunk.bit_length() - 1}" for chunk in CHUNK_SWEEP) + " |",
                  "|---|" + "---:|" * len(CHUNK_SWEEP)]
        for label, size in (("", loss["vocab"]), ("_262k", 262_144)):
            sweep = loss[f"chunk_sweep{label}_seconds"]
            lines.append(f"| {size} | " + " | ".join(f"{sweep[str(chunk)]:.2f} s" for chunk in CHUNK_SWEEP) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loss-only", action="store_true", help="rerun only the loss measurements, keep the steps")
    args = parser.parse_args()

    import torch

    from prunetool.commands.heal import LORA_ALPHA_PER_RANK, HealRequest, lora_targets
    from prunetool.model.in_memory import prune_in_memory
    from prunetool.model.loading import load_model
    from prunetool.repair.distill import distill_loss
    from prunetool.sources import resolve_model
    from provenance import write_results
    from peft import LoraConfig, get_peft_model

    source = resolve_model(args.model)
    ce_weight = HealRequest.ce_weight  # heal's default loss
    results = {"setting": {"model": args.model, "removed": list(REMOVED), "batch": args.batch, "ce_weight": ce_weight,
                           "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                           "threads": torch.get_num_threads()}, "modes": {}}
    modes = (("float32", "float32", False), ("bf16 autocast", "bfloat16", True))
    if args.loss_only:
        import json

        previous = json.loads((ROOT / "bench" / "results" / "heal_step.json").read_text())
        results["modes"], results["steps_measured_by"] = previous["modes"], previous["provenance"]["command"]
        modes = ()
    vocab = None
    for mode, teacher_dtype, autocast in modes:
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
            loss = distill_loss(student_logits, teacher_logits, batch, ce_weight=ce_weight)
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

    if vocab is None:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(source.path).vocab_size
    tokens = args.batch * (args.seq_len - 1)
    from prunetool.repair.distill import CPU_CHUNK_ELEMENTS

    results["loss"] = {"tokens": tokens, "vocab": vocab, "steps": args.steps, "cpu_chunk_elements": CPU_CHUNK_ELEMENTS}
    for label, size in (("", vocab), ("_262k", 262_144)):  # this model's vocabulary, and Gemma 3's
        for name in LOSSES:
            seconds, peak = loss_cost(name, tokens, size, args.warmup, args.steps if not label else 5)
            results["loss"][f"{name}{label}_seconds"] = seconds
            results["loss"][f"{name}{label}_peak_bytes"] = peak
        results["loss"][f"chunk_sweep{label}_seconds"] = {
            str(chunk): loss_cost("mixed_fused", tokens, size, args.warmup, args.steps if not label else 5, chunk)[0]
            for chunk in CHUNK_SWEEP}
    print(results["loss"], file=sys.stderr)
    write_results("heal_step", results)


if __name__ == "__main__":
    main()
