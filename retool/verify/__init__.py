"""A finished run checked from its files alone: every rule of the rollout, the scores, the datums and the checkpoints
re-derived from what the run folder keeps (`python -m retool verify RUN`)."""
