"""Repair after layer removal: fit what a removed block did and fold it into kept weights (`prune --patch`).

- `sites`: where each contiguous run's patch can go (down_proj, through a post-MLP norm, embeddings, or
  a recorded reason why nowhere);
- `capture`: one hooked calibration pass of the unpruned model gathering float64 statistics (and a
  bounded float32 token cache for non-quadratic objectives);
- `patch`: the pure maths (accumulate, solve, fold, refine);
- `fit`: per run, the new tensors and the record prune.json keeps.
"""

from prunetool.repair.capture import capture_runs
from prunetool.repair.fit import OBJECTIVES, RunPatch, fit_runs
from prunetool.repair.sites import PatchSite, contiguous_runs, plan_sites

__all__ = ["OBJECTIVES", "PatchSite", "RunPatch", "capture_runs", "contiguous_runs", "fit_runs", "plan_sites"]
