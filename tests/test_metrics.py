"""The O(T*d) metric forms against explicit slow definitions."""

import math

import pytest
import torch

from prunetool.model.metrics import (
    angular_distance_matrix,
    block_influence_per_window,
    mean_consecutive_cosine,
    mean_pairwise_cosine,
    minmax,
)


def gram_mean_cosine(x: torch.Tensor) -> float:
    """The definition: build the T x T cosine matrix and average its off-diagonal entries."""
    u = x.double() / x.double().norm(dim=-1, keepdim=True)
    gram = u @ u.T
    t = x.shape[0]
    return ((gram.sum() - gram.diagonal().sum()) / (t * (t - 1))).item()


def loop_mean_cosine(x: torch.Tensor) -> float:
    """Even slower: an explicit double loop over ordered pairs i != j."""
    x = x.double()
    t, total = x.shape[0], 0.0
    for i in range(t):
        for j in range(t):
            if i != j:
                total += torch.nn.functional.cosine_similarity(x[i], x[j], dim=0).item()
    return total / (t * (t - 1))


@pytest.mark.parametrize("t,d", [(2, 3), (7, 16), (64, 8), (300, 64)])
def test_pairwise_cosine_equals_gram_matrix(t, d):
    torch.manual_seed(t)
    x = torch.randn(t, d) + 0.3  # a shared offset so the mean is far from zero
    assert mean_pairwise_cosine(x).item() == pytest.approx(gram_mean_cosine(x), abs=1e-6)


def test_pairwise_cosine_equals_double_loop():
    torch.manual_seed(1)
    x = torch.randn(6, 5)
    assert mean_pairwise_cosine(x).item() == pytest.approx(loop_mean_cosine(x), abs=1e-6)


def test_pairwise_cosine_batched_heads_match_each_slice():
    torch.manual_seed(2)
    q = torch.randn(3, 4, 50, 16)  # (B, H, T, D)
    batched = mean_pairwise_cosine(q)
    assert batched.shape == (3, 4)
    for b in range(3):
        for h in range(4):
            assert batched[b, h].item() == pytest.approx(gram_mean_cosine(q[b, h]), abs=1e-6)


def test_pairwise_cosine_extremes_and_scale_invariance():
    same = torch.ones(10, 4)
    assert mean_pairwise_cosine(same).item() == pytest.approx(1.0)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert mean_pairwise_cosine(opposite).item() == pytest.approx(-1.0)
    x = torch.randn(20, 8)
    scaled = x * torch.rand(20, 1) * 100
    assert mean_pairwise_cosine(scaled).item() == pytest.approx(mean_pairwise_cosine(x).item(), abs=1e-6)


def test_pairwise_cosine_bfloat16_input_is_computed_in_float():
    torch.manual_seed(3)
    x = torch.randn(128, 32)
    assert mean_pairwise_cosine(x.bfloat16()).item() == pytest.approx(gram_mean_cosine(x.bfloat16().float()), abs=1e-5)


def test_pairwise_cosine_needs_two_tokens():
    with pytest.raises(ValueError):
        mean_pairwise_cosine(torch.randn(1, 4))


def test_consecutive_cosine_is_mean_of_neighbour_pairs():
    torch.manual_seed(4)
    x = torch.randn(9, 6)
    expected = sum(torch.nn.functional.cosine_similarity(x[t], x[t + 1], dim=0).item() for t in range(8)) / 8
    assert mean_consecutive_cosine(x).item() == pytest.approx(expected, abs=1e-6)


def test_block_influence_per_window():
    torch.manual_seed(5)
    a, b = torch.randn(2, 11, 7), torch.randn(2, 11, 7)
    got = block_influence_per_window(a, b)
    for w in range(2):
        per_token = [1 - torch.nn.functional.cosine_similarity(a[w, t], b[w, t], dim=0).item() for t in range(11)]
        assert got[w].item() == pytest.approx(sum(per_token) / 11, abs=1e-6)
    assert block_influence_per_window(a, a * 3).abs().max().item() < 1e-6


def test_angular_distance_matrix():
    torch.manual_seed(6)
    states = torch.randn(3, 5, 10)  # (W, L+1, d)
    got = angular_distance_matrix(states)
    assert got.shape == (5, 5)
    assert torch.equal(got, got.T)
    assert got.diagonal().abs().max().item() == 0.0
    for i in range(5):
        for j in range(5):
            if i == j:
                continue
            per_window = [
                math.acos(max(-1.0, min(1.0, torch.nn.functional.cosine_similarity(
                    states[w, i].double(), states[w, j].double(), dim=0).item()))) / math.pi
                for w in range(3)
            ]
            assert got[i, j].item() == pytest.approx(sum(per_window) / 3, abs=1e-9)


def test_minmax():
    assert minmax(torch.tensor([2.0, 4.0, 3.0])).tolist() == [0.0, 1.0, 0.5]
    assert minmax(torch.tensor([5.0, 5.0])).tolist() == [0.0, 0.0]
