"""A node under a central scheduler stays until its target is complete. Luigi keeps a worker with `[worker]
keep_alive` alive while a task its command needs is pending; once the last ones run on other nodes it leaves
before they end, and a node that dies then leaves them to no one. Here a node also stays while such a task
runs elsewhere, so that it takes the task over if that node dies (the scheduler makes it pending again)."""

from __future__ import annotations

import luigi.worker

_luigi_keep_alive = luigi.worker.Worker._keep_alive  # Luigi has no setting for this: its decision, extended


def _keep_alive_while_others_run(self: luigi.worker.Worker, get_work_response) -> bool:
    return _luigi_keep_alive(self, get_work_response) or (
        self._config.keep_alive and bool(get_work_response.running_tasks)
    )


luigi.worker.Worker._keep_alive = _keep_alive_while_others_run
