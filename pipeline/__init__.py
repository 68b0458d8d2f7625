"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

import pipeline.cluster  # noqa: F401  (a node stays until its target is complete)
import pipeline.errors  # noqa: F401  (input errors as one line)
import pipeline.outcome  # noqa: F401  (first: its exit handler runs last)
from pipeline.cold_start import ColdStart, SFTExamples  # noqa: F401
from pipeline.config import SECTIONS  # noqa: F401  (the settings' Luigi config sections)
from pipeline.evaluation import BeforeAfter, Evaluate, Report  # noqa: F401
from pipeline.tasks import (  # noqa: F401
    ExecuteRound,
    Prompts,
    SampleRound,
    ScoreShard,
    ScoreTrajectories,
    ShardDatums,
    TrainStep,
)
