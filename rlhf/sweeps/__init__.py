"""Hyper-parameter sweeps: search spaces (`space`), Optuna (`optuna_search`), ranking (`ranking`), side-by-side
comparison (`compare`), plots (`plots`) and reward-model over-optimisation (`overoptimisation`)."""
