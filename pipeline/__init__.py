"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

from pipeline.tasks import BuildDatums, Evaluate, ExecuteRound, Prompts, Report, SampleRound, ScoreTrajectories, TrainStep  # noqa: F401
from pipeline.config import retool  # noqa: F401
