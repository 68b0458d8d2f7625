"""Every stage of the pipeline as a function from the tables (or files) it reads to what it writes:
the rollout (prompts, rounds, scores, datums), training (cold start, PPO step) and summaries
(metrics, evaluations, the before/after table)."""
