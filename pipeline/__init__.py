"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

from pipeline.config import retool  # noqa: F401
from pipeline.tasks import (  # noqa: F401
    BeforeAfter,
    BuildDatums,
    ColdStart,
    Evaluate,
    ExecuteRound,
    Prompts,
    Report,
    SampleRound,
    ScoreTrajectories,
    SFTExamples,
    TrainStep,
)
