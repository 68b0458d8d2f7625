"""ReTool-style reinforcement learning, the rules of every stage as plain functions over plain data
(the jobs that read and write each stage's files are in `jobs/`, the Luigi tasks that schedule them in
`pipeline/`). Packages by concern, lowest first:

- `config`      the settings, one frozen dataclass per section
- `files`       the run folder's layout, the Parquet contract, atomic writes
- `weights`     the models a run starts from and the checkpoints it writes
- `data`        questions, worked solutions, synthetic problem families, the reward
- `protocol`    chat templates, prompt rendering, tool-call parsing
- `sandbox`     running the model's code: the call, its isolation, the runner, the fork server
- `sampling`    the sampler contract and its engines (transformers, vLLM in-process, vLLM server)
- `rollout`     the multi-turn state machine, its replay from files, PPO datums
- `training`    one PPO or supervised step, packing, the memory plan, the cold start, checkpoints
- `evaluation`  scores and intervals, per-step metrics, queries over a run folder, the report
- `run`         what a stage runs with: the run's set-up, once per command, and the jobs' shared caches
- `cli`         the command-line tools (`python -m retool COMMAND`)
"""
