"""Questions and worked solutions: their files, the synthetic problem families, the reward."""
