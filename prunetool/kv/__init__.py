"""KV-cache budgets applied: per-layer schedules and SnapKV-style compression at prefill."""
