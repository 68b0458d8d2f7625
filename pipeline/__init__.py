"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

from pipeline.tasks import ExecuteRound, Prompts, SampleRound, ScoreTrajectories  # noqa: F401
from pipeline.config import retool  # noqa: F401
