"""Scores with intervals, per-step metrics, queries over a run folder, and the report."""
