"""Evaluation: lm-eval on local copies of standard tasks, hop probes and held-out perplexity."""
