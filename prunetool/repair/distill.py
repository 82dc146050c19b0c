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


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of T^2 KL(softmax(teacher/T) || softmax(student/T)); logits (..., V), float32 maths.

    Written as soft-target cross-entropy minus the teacher's entropy: KL = CE(p_T, q_T) - H(p_T). The entropy
    needs no gradient and the cross-entropy is one fused kernel, which measured 2x faster forward and backward
    than log_softmax + kl_div on SmolLM2's 49k vocabulary (1020 tokens, 2 CPU threads).
    """
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab).float() / temperature
    with torch.no_grad():
        teacher = F.log_softmax(teacher_logits.reshape(-1, vocab).float() / temperature, dim=-1)
        probabilities = teacher.exp()
        negative_entropy = (probabilities * teacher).sum(-1)
        del teacher
    cross_entropy = F.cross_entropy(student, probabilities, reduction="none")
    return (cross_entropy + negative_entropy).mean() * temperature**2


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, input_ids: torch.Tensor, *,
                 temperature: float = 1.0, ce_weight: float = 0.0) -> torch.Tensor:
    """(1 - a) KL_T + a CE on next-token predictions of windows (B, T): positions 0..T-2 predict 1..T-1."""
    student = student_logits[:, :-1]
    loss = kl_loss(student, teacher_logits[:, :-1], temperature) if ce_weight < 1 else student.new_zeros(())
    if ce_weight > 0:
        ce = F.cross_entropy(student.float().reshape(-1, student.shape[-1]), input_ids[:, 1:].reshape(-1))
        loss = (1 - ce_weight) * loss + ce_weight * ce
    return loss


def warmup_steps(total: int) -> int:
    return max(1, math.ceil(WARMUP_FRACTION * total))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): warmup, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
