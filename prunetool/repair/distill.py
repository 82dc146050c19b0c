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


CHUNK_ELEMENTS = 2**24  # logits handled at once by kl_loss: 64 MB of float32 temporaries per tensor


class _ChunkedKL(torch.autograd.Function):
    """T^2 KL summed over rows, and its gradient T (q_T - p_T), computed together one chunk of rows at a time.

    Autograd would keep log_softmax outputs and float copies of the whole (tokens x vocab) logits alive
    for the backward; here the only full-size tensor is the gradient itself, in the logits' dtype, so a
    262k vocabulary (Gemma 3) costs one extra logits-sized buffer rather than five.
    """

    @staticmethod
    def forward(ctx, student, teacher, temperature, rows):
        gradient = torch.empty_like(student)
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for start in range(0, student.shape[0], rows):
            q_log = F.log_softmax(student[start:start + rows].float() / temperature, dim=-1)
            p_log = F.log_softmax(teacher[start:start + rows].float() / temperature, dim=-1)
            p = p_log.exp()
            total += torch.vdot(p.view(-1), p_log.sub_(q_log).view(-1)).double()  # sum p (log p - log q)
            gradient[start:start + rows] = q_log.exp_().sub_(p).mul_(temperature)
        ctx.save_for_backward(gradient)
        return (total * temperature**2).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        (gradient,) = ctx.saved_tensors
        # in place: the graph is used once (no retain_graph), so the buffer is not needed again
        return gradient.mul_(grad_output.to(gradient.dtype)), None, None, None


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Mean over tokens of T^2 KL(softmax(teacher/T) || softmax(student/T)); logits (..., V), float32 maths.

    Loss and gradient come from one chunked pass (_ChunkedKL): as fast as autograd through log_softmax +
    kl_div on SmolLM2's 49k vocabulary with half its extra memory, and a quarter of it on a 262k vocabulary
    (1.25x slower there; bench/heal_step.py).
    """
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)
    teacher = teacher_logits.detach().reshape(-1, vocab)
    rows = max(1, chunk_elements // vocab)
    return _ChunkedKL.apply(student, teacher, float(temperature), rows) / student.shape[0]


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
