"""RoPE frequencies and the channel pair that carries a head's attention. Pure functions.

HF models rotate dimension i with dimension i + r/2 (r = rotary dims, r = head_dim unless the rotary
embedding is partial) by the angle position * theta_i; dimensions from r on are not rotated. A pair's
norm |q_i| = sqrt(q_i^2 + q_{i+r/2}^2) is unchanged by the rotation, so the query-key logit splits
into per-pair terms of size |q_i||k_i| whose phase turns by theta_i per token of offset: a head whose
|q||k| mass sits in pair i repeats its pattern every 2*pi/theta_i tokens (TAPPA's seasonal period).
"""

import math

import torch


def rope_angles(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """theta per rotary pair, read off the cos/sin the model applies at its first two positions.

    cos, sin: (..., T, r) as passed to the attention (HF repeats each angle for both halves, and may
    scale both by an attention factor, which atan2 ignores). Reading the applied tables rather than a
    config keeps per-layer bases (Gemma 3's local vs global) and scaled RoPE variants right.
    """
    cos, sin = cos.reshape(-1, *cos.shape[-2:])[0].double(), sin.reshape(-1, *sin.shape[-2:])[0].double()
    step = torch.atan2(sin[1], cos[1]) - torch.atan2(sin[0], cos[0])
    step = torch.remainder(step + math.pi, 2 * math.pi) - math.pi  # wrap to (-pi, pi]
    return step[: cos.shape[-1] // 2].abs()


def channel_norms(x: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """(B, H, T, D) -> (H, C): summed over batch, mean over tokens, of each channel's norm.

    Channels are the r/2 rotary pairs, then every unrotated dimension on its own (theta = 0).
    """
    half = rotary_dims // 2
    x = x.float()
    pairs = torch.sqrt(x[..., :half] ** 2 + x[..., half:rotary_dims] ** 2)
    channels = torch.cat([pairs, x[..., rotary_dims:].abs()], dim=-1)
    return channels.mean(-2).sum(0).double()


def channel_thetas(angles: torch.Tensor, head_dim: int) -> torch.Tensor:
    """theta per channel: the rotary pairs' angles, then zeros for unrotated dimensions."""
    rotary = 2 * angles.numel()
    return torch.cat([angles.double(), torch.zeros(head_dim - rotary, dtype=torch.float64)])


def dominant_channels(query_norms: torch.Tensor, key_norms: torch.Tensor, thetas: torch.Tensor,
                      longest_visible: float) -> list[dict]:
    """Per query head: the channel with the most |q||k| mass (its share, theta, period 2*pi/theta), and
    the same among channels whose period is at most `longest_visible` tokens.

    Low-frequency pairs usually carry most mass but turn too slowly to repeat inside a window; the
    strongest pair that can repeat there is the one that predicts a seasonal head's visible period.
    query_norms (H, C), key_norms (H_kv, C): query heads share their KV head in order (GQA).
    """
    group = query_norms.shape[0] // key_norms.shape[0]
    mass = query_norms * key_norms.repeat_interleave(group, dim=0)
    share = mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)
    periods = [2 * math.pi / theta if theta > 0 else None for theta in thetas.tolist()]
    visible = torch.tensor([period is not None and period <= longest_visible for period in periods])
    result = []
    for head in range(mass.shape[0]):
        channel = int(mass[head].argmax())
        entry = {"channel": channel, "share": share[head, channel].item(), "theta": thetas[channel].item(),
                 "period": periods[channel], "visible_channel": None, "visible_share": None, "visible_period": None}
        strongest = int(torch.where(visible, mass[head], torch.full_like(mass[head], -1.0)).argmax())
        if visible[strongest] and mass[head, strongest] > 0:
            entry |= {"visible_channel": strongest, "visible_share": share[head, strongest].item(),
                      "visible_period": periods[strongest]}
        result.append(entry)
    return result
