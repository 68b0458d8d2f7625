"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

from pipeline.config import SECTIONS  # noqa: F401  (the settings' Luigi config sections)
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
