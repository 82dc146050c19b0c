"""One orchestrator per command, side by side: each wires its stages (source, calibration, capture,
selection and search, surgery, verification, evaluation) and returns what the CLI renders.

They share only what lies one layer down: the model cache key (sources.model_key), the held-out window
contract (calibration.HOLDOUT_WINDOWS, CalibrationSet.held_out), progress (progress.py) and the
current run (runs.py).
"""
