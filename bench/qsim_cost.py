"""Query self-similarity: prunetool's O(T*D) form against the explicit T x T Gram matrix.

Run: .venv/bin/python bench/qsim_cost.py [--heads 9] [--head-dim 64] [--repeats 5]
Writes bench/results/qsim_cost.json; `table` renders it for docs/benchmarks.md (bench/render_docs.py).

Both compute the mean cosine over all ordered pairs of distinct query vectors, per head, for one
window of T tokens (SmolLM2-135M's shape by default: 9 query heads of 64). The Gram form normalises,
forms U U^T (H x T x T), and averages its off-diagonal entries; prunetool's form uses
sum_{i!=j} u_i.u_j = ||sum_i u_i||^2 - T. Time is the median of --repeats calls after one warm-up;
memory is the largest intermediate tensor each form allocates (the Gram matrix, or the unit vectors).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from provenance import write_results

from prunetool.model.metrics import mean_pairwise_cosine


def gram_mean_cosine(q: torch.Tensor) -> torch.Tensor:
    """(H, T, D) -> (H,): the textbook form, every pair's cosine materialised."""
    u = F.normalize(q.double(), dim=-1)
    gram = u @ u.transpose(-1, -2)  # (H, T, T)
    t = q.shape[-2]
    off_diagonal = gram.sum((-1, -2)) - gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return off_diagonal / (t * (t - 1))


def timed(fn, q, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn(q)  # warm-up
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn(q)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for t in map(int, args.lengths.split(",")):
        q = torch.randn(args.heads, t, args.head_dim) + 0.5  # a shared offset, as real queries have
        gram_s, want = timed(gram_mean_cosine, q, args.repeats)
        linear_s, got = timed(mean_pairwise_cosine, q, args.repeats)
        rows.append({"tokens": t, "gram_seconds": gram_s, "linear_seconds": linear_s,
                     "gram_bytes": args.heads * t * t * 8, "unit_vector_bytes": args.heads * t * args.head_dim * 4,
                     "max_abs_diff": (got - want).abs().max().item()})
    results = {"heads": args.heads, "head_dim": args.head_dim, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "rows": rows}
    write_results("qsim_cost", results)
    print(table(results))


def table(results: dict) -> str:
    """The docs table: one row per window length."""
    lines = [f"{results['heads']} heads x {results['head_dim']} dims, float32 queries, {results['threads']} threads, "
             f"median of {results['repeats']} calls after a warm-up:", "",
             "| T | Gram ms | O(T*D) ms | speed-up | Gram matrix MB | unit vectors MB | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['tokens']} | {row['gram_seconds'] * 1e3:.2f} | {row['linear_seconds'] * 1e3:.3f} | "
                     f"{row['gram_seconds'] / row['linear_seconds']:.0f}x | {row['gram_bytes'] / 1e6:.0f} | "
                     f"{row['unit_vector_bytes'] / 1e6:.1f} | {row['max_abs_diff']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
