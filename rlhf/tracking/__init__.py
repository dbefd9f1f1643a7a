"""Tracking in MLflow: `client` is the one module that imports mlflow; `store` (the SQLite store and file digests),
`metrics_writer` (batched, optionally background, metric writes) and `default_view` (the runs' default charts) sit
on it."""
