"""The experiment tracker a run logs to ([run] tracker): each training step's scalars (those of its
metrics.parquet) and each evaluation's summary, offline by default where the library has an offline mode.

- tensorboard: event files in runs/<run>/tensorboard/ (`tensorboard --logdir runs`);
- wandb: offline runs in runs/<run>/wandb/ (`wandb sync runs/<run>/wandb/offline-run-*`), or online when
  WANDB_MODE says so; project WANDB_PROJECT, else "retool";
- mlflow: the server in MLFLOW_TRACKING_URI, else the SQLite store runs/<run>/mlflow.db
  (`mlflow ui --backend-store-uri sqlite:///runs/<run>/mlflow.db`); experiment MLFLOW_EXPERIMENT_NAME, else "retool".

Every command of a run logs to the same tracker run: its id is drawn once and kept in runs/<run>/tracking.json.
The Parquet files stay the record; the tracker is a view of them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from retool.config.settings import TRACKERS, RunSettings, SettingsError, frozen
from retool.files.atomic import publish_once
from retool.files.layout import RunFolder

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
RUN_ID_TAG = "retool.run_id"  # the MLflow tag that finds a run's tracker run again


def check_tracker(kind: str) -> None:
    """Fails before any stage runs when the tracker's library is not installed."""
    if kind in EXTRAS:
        module, extra = EXTRAS[kind]
        if importlib.util.find_spec(module) is None:
            raise SettingsError(
                f"setting [run] tracker = {kind} needs the {module} package, which is not installed: "
                f"pip install 'retool-pipeline[{extra}]' (or set [run] tracker = none)"
            )


def scalars(values: dict) -> dict[str, float]:
    """The numbers among `values` (not flags, not the step), as a tracker takes them."""
    return {
        name: float(value)
        for name, value in values.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool) and value == value
    }


@dataclass(frozen=True)
class Tracker:
    kind: str  # one of TRACKERS
    folder: RunFolder  # the run's folder: offline files and the tracker run's id live there
    run_name: str  # the name the tracker shows
    settings: dict = field(default_factory=dict)  # the run's frozen settings by section: the tracker run's params

    @classmethod
    def of(cls, settings: RunSettings) -> Tracker:
        """The tracker of a run, as its settings name it."""
        return cls(settings.run.tracker, RunFolder(settings.run_dir), settings.run.name, frozen(settings))

    def run_id(self) -> str:
        """The tracker run's id: drawn by the run's first command, read by every later one."""
        record = self.folder.tracking_record
        publish_once(record, json.dumps({"id": f"{self.run_name}-{uuid.uuid4().hex[:8]}"}))  # the first draw wins
        return json.loads(record.read_text())["id"]

    def log(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        """Logs scalars at training step `step` (-1: before RL), each name under `prefix`."""
        self.log_steps([(step, values)], prefix)

    def log_steps(self, rows: list[tuple[int, dict[str, float]]], prefix: str = "") -> None:
        """Logs (step, scalars) rows in one session of the tracker, each name under `prefix`."""
        assert self.kind in TRACKERS, self.kind
        rows = [(step, {f"{prefix}{name}": value for name, value in values.items()}) for step, values in rows]
        rows = [(step, values) for step, values in rows if values]
        if self.kind == "none" or not rows:
            return
        {"tensorboard": self._tensorboard, "wandb": self._wandb, "mlflow": self._mlflow}[self.kind](rows)

    def params(self) -> dict[str, str]:
        """The settings as flat `section.name` params."""
        return {
            f"{section}.{name}": str(value)
            for section, values in self.settings.items()
            for name, value in values.items()
        }

    def _tensorboard(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(self.folder.tensorboard)) as writer:
            for step, values in rows:
                for name, value in values.items():
                    writer.add_scalar(name, value, step)

    def _wandb(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        import wandb

        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "retool"),
            name=self.run_name,
            id=self.run_id(),
            dir=str(self.folder.path),
            mode=None if "WANDB_MODE" in os.environ else "offline",
            resume="allow",
            config=self.settings,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        try:
            # Each command is its own W&B session, whose own step counter restarts: plot against the run's step.
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            for step, values in rows:
                run.log({"step": step, **values})
        finally:
            run.finish()

    def _mlflow(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines on database set-up are not the run's
            logging.getLogger(name).setLevel(logging.WARNING)
        store = (self.folder.path / "mlflow.db").resolve()
        client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store}")
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "retool")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_id = self.run_id()
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if found:
            mlflow_run = found[0]
            client.update_run(mlflow_run.info.run_id, status="RUNNING")
        else:  # the settings as params, once: a run's settings are frozen
            mlflow_run = client.create_run(experiment_id, run_name=self.run_name, tags={RUN_ID_TAG: run_id})
            params = [Param(key, value) for key, value in self.params().items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                client.log_batch(mlflow_run.info.run_id, params=params[start : start + 100])
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for step, values in rows for key, value in values.items()]
        try:
            client.log_batch(mlflow_run.info.run_id, metrics=metrics)
        except Exception:
            client.set_terminated(mlflow_run.info.run_id, "FAILED")
            raise
        # Each command's logging ends the run's record so far: FINISHED until a later step logs again.
        client.set_terminated(mlflow_run.info.run_id, "FINISHED")
