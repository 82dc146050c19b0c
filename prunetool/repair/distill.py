"""Pure maths of `prunetool heal`: the distillation loss and the learning-rate schedule.

Loss (per predicted token, averaged over tokens):
    KL_T = T^2 * sum_v p_T(v) (log p_T(v) - log q_T(v)),  p_T = softmax(teacher / T), q_T = softmax(student / T)
         = T^2 * (CE(p_T, q_T) - H(p_T))
    loss = (1 - a) KL_T + a CE(student, next token)
Forward KL (teacher || student), as Minitron and NeMo's KD loss use; the T^2 keeps gradient sizes comparable
across temperatures (Hinton et al.). CE is at temperature 1.

Schedule: linear warmup from 0 to the peak over `warmup` steps, then cosine decay to 0 at `total` steps.
"""

import math

import torch
import torch.nn.functional as F

WARMUP_FRACTION = 0.1  # of the optimizer steps; at least one step


# Logits elements handled at once. On the CPU small chunks stay in cache and in malloc's reused memory
# (large temporaries are fresh pages every time): in bench/heal_step.py's runs 2^18 was the fastest or
# near it on both vocabularies, 2^24 the slowest on 262k words. On a GPU every chunk costs a dozen kernel
# launches, so chunks stay large there.
CPU_CHUNK_ELEMENTS = 2**18
ACCELERATOR_CHUNK_ELEMENTS = 2**24  # 64 MB of float32 temporaries per tensor


def chunk_elements_for(device: torch.device) -> int:
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


class _ChunkedDistill(torch.autograd.Function):
    """(1 - a) T^2 KL + a CE summed over rows, and its gradient, computed together one chunk of rows at a time.

    The gradient with respect to the student's logits is (1 - a) T (q_T - p_T) + a (q_1 - onehot(target)).
    Autograd would keep log_softmax outputs and float copies of the whole (tokens x vocab) logits alive for
    the backward, once for the KL and once more for the CE; here the only full-size tensor is the gradient
    itself, in the logits' dtype, so a 262k vocabulary (Gemma 3) costs one extra logits-sized buffer rather
    than five, whatever the mix.
    """

    @staticmethod
    def forward(ctx, student, teacher, targets, temperature, ce_weight, rows):
        kl_weight = 1.0 - ce_weight
        shared = 0 < ce_weight < 1 and temperature == 1.0  # KL and CE share q: grad = q - (1 - a) p - a onehot
        gradient = torch.empty_like(student)
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for start in range(0, student.shape[0], rows):
            logits = student[start:start + rows].float()
            picked = None if targets is None else targets[start:start + rows, None]
            chunk_gradient = None
            if kl_weight > 0:
                log_q = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
                scaled = teacher[start:start + rows].float()
                log_p = F.log_softmax(scaled if temperature == 1.0 else scaled / temperature, dim=-1)
                p = log_p.exp()
                kl = torch.vdot(p.view(-1), log_p.sub_(log_q).view(-1)).double()  # sum p (log p - log q)
                total += kl_weight * temperature**2 * kl
                if shared:
                    total -= ce_weight * log_q.gather(1, picked).sum().double()
                    chunk_gradient = log_q.exp_().sub_(p, alpha=kl_weight)
                else:
                    chunk_gradient = log_q.exp_().sub_(p).mul_(kl_weight * temperature)
            if ce_weight > 0 and not shared:
                log_q1 = F.log_softmax(logits, dim=-1)
                total -= ce_weight * log_q1.gather(1, picked).sum().double()
                ce_gradient = log_q1.exp_().mul_(ce_weight)
                chunk_gradient = ce_gradient if chunk_gradient is None else chunk_gradient.add_(ce_gradient)
            if ce_weight > 0:
                chunk_gradient.scatter_add_(1, picked, chunk_gradient.new_full(picked.shape, -ce_weight))
            gradient[start:start + rows] = chunk_gradient
        ctx.save_for_backward(gradient)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        (gradient,) = ctx.saved_tensors
        # in place: the graph is used once (no retain_graph), so the buffer is not needed again
        return gradient.mul_(grad_output.to(gradient.dtype)), None, None, None, None, None


def token_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, targets: torch.Tensor | None, *,
               temperature: float = 1.0, ce_weight: float = 0.0, chunk_elements: int | None = None) -> torch.Tensor:
    """Mean over tokens of (1 - a) T^2 KL(softmax(teacher/T) || softmax(student/T)) + a CE(student, targets).

    Logits (..., V) already aligned with their targets (...); float32 maths. The teacher may be None when
    a = 1, the targets when a = 0. Loss and gradient come from one chunked pass (_ChunkedDistill): faster
    than autograd on a 262k vocabulary and a fifth to a third of its extra memory (bench/heal_step.py).
    """
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must lie in [0, 1], got {ce_weight}")
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)
    teacher = None if ce_weight == 1.0 else teacher_logits.detach().reshape(-1, vocab)
    flat_targets = None if ce_weight == 0.0 else targets.reshape(-1)
    rows = max(1, (chunk_elements or chunk_elements_for(student.device)) // vocab)
    total = _ChunkedDistill.apply(student, teacher, flat_targets, float(temperature), float(ce_weight), rows)
    return total / student.shape[0]


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            chunk_elements: int | None = None) -> torch.Tensor:
    """Mean over tokens of T^2 KL(softmax(teacher/T) || softmax(student/T)); logits (..., V)."""
    return token_loss(student_logits, teacher_logits, None, temperature=temperature, chunk_elements=chunk_elements)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, input_ids: torch.Tensor, *,
                 temperature: float = 1.0, ce_weight: float = 0.0) -> torch.Tensor:
    """(1 - a) KL_T + a CE on next-token predictions of windows (B, T): positions 0..T-2 predict 1..T-1.

    With a = 1 (plain fine-tuning) the teacher is not read and may be None.
    """
    teacher = None if teacher_logits is None else teacher_logits[:, :-1]  # token_loss ignores it at a = 1
    return token_loss(student_logits[:, :-1], teacher, input_ids[:, 1:], temperature=temperature, ce_weight=ce_weight)


def warmup_steps(total: int) -> int:
    return max(1, math.ceil(WARMUP_FRACTION * total))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): warmup, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
