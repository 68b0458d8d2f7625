"""`python -m bench.gpu --dry-run`: every phase of the GPU check on the CPU with tiny shapes, its figures, and a phase
that fails recorded while the others still run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.gpu_harness import NotRunHere, run_phases
from tests.conftest import REPO

PHASES = (
    "environment",
    "fork_check",
    "checkpoint_keys",
    "tiny_lora",
    "bfloat16_updates",
    "lora_step_4b",
    "full",
    "save_load",
    "resident",
    "fsdp_held_round_trip",
    "gated_delta",
)


def dry_run(out, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *options]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_gpu_check_runs_every_phase_on_a_cpu_and_writes_its_figures(tmp_path):
    out = tmp_path / "gpu-check.json"
    done = dry_run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert not figures["skipped"] and not figures["failed"] and not figures["not_run"]
    assert all(name in figures for name in PHASES)
    fork = figures["fork_check"]  # on the CPU both checks leave CUDA alone, and the forked child computes
    assert fork["nvml_check_keeps_fork_usable"] and fork["plain_check"]["forked_child_ok"]
    assert not fork["nvml_check"]["parent_cuda_initialized"] and not fork["plain_check"]["parent_cuda_initialized"]
    keys = figures["checkpoint_keys"]
    assert keys["saved_tensors"] > 0 and not keys["missing_language_model_names"] and not keys["names_not_published"]
    lora = figures["tiny_lora"]  # a LoRA step's adapter: every tensor names a trained module, served under the LM
    assert lora["adapter_tensors"] > 0 and not lora["adapter_tensors_matching_no_trained_module"]
    assert lora["linear_attention_tensors"] > 0 and lora["served_under_language_model"]
    updates = figures["bfloat16_updates"]
    for rate in ("4e-06", "1e-05", "4e-05"):
        assert updates[f"lr {rate}, float32_master"] > 0.99 > updates[f"lr {rate}, bfloat16_weights"]
    for name in ("lora_step_4b", "full"):
        assert figures[name]["tokens_per_second"] > 0 and "mfu_of_measured_peak" in figures[name]
    # The full fine-tune as the recipe resolves it: float32 weights, FSDP2 where several processes train.
    assert figures["full"]["trainer"]["dtype"] == "float32" and figures["full"]["trainer"]["data_parallel"] == "fsdp"
    assert figures["lora_step_4b"]["trainer"]["data_parallel"] == "ddp"
    assert figures["save_load"]["checkpoint_mib"] > 0
    resident = figures["resident"]  # held through the host and back: on a CPU, the same bits as loaded from disk
    assert (
        resident["lora_max_difference_held_against_loaded"] == resident["full_max_difference_held_against_loaded"] == 0
    )
    fsdp = figures["fsdp_held_round_trip"]  # the sharded state left for float64 and came back bit for bit
    assert fsdp["backend"] == "gloo" and fsdp["state_left_the_device"] and fsdp["state_came_back"]
    assert (
        fsdp["next_forward_max_difference_against_gathered"] == fsdp["next_update_max_difference_against_stayed"] == 0
    )
    delta = figures["gated_delta"]
    assert delta["tokens"] == 256 and delta["own_float32_loop_against_transformers_max"] < 1e-6
    float32_state = delta["against_chunked"]["recurrent_state_float32"]
    bfloat16_state = delta["against_chunked"]["recurrent_state_bfloat16"]
    assert set(float32_state) == {"0-16", "16-64", "64-256"}
    assert all(bucket["max"] < 1e-5 for bucket in float32_state.values())
    assert all(bfloat16_state[b]["mean"] > float32_state[b]["mean"] for b in float32_state)


def test_a_phase_that_fails_is_recorded_and_every_other_phase_still_runs(tmp_path):
    """--fail-phase makes one phase raise (the check of the check): the JSON names it with its error and traceback,
    every other phase still runs, and the exit status says that one failed."""
    out = tmp_path / "gpu-check.json"
    done = dry_run(out, "--fail-phase", "checkpoint_keys")
    assert done.returncode == 1, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["failed"]) == {"checkpoint_keys"} and "checkpoint_keys" not in figures
    failure = figures["failed"]["checkpoint_keys"]
    assert failure["error"].startswith("RuntimeError: ") and "--fail-phase" in failure["error"]
    assert failure["traceback"] and failure["traceback"][-1] == failure["error"]
    assert all(name in figures for name in PHASES if name != "checkpoint_keys")
    assert figures["resident"]["full_max_difference_held_against_loaded"] == 0  # a phase after it, whole


def test_an_unknown_phase_to_fail_is_refused(tmp_path):
    done = dry_run(tmp_path / "gpu-check.json", "--fail-phase", "no_such_phase")
    assert done.returncode == 2 and "no such phase" in done.stderr


def test_each_phase_is_isolated_and_its_files_removed(tmp_path):
    """In process: a phase that raises is recorded and the next runs; one that cannot run here is named with its
    reason; a phase past the deadline is skipped; each phase's folder is removed after it; the JSON is written."""
    import time

    scratch, seen = tmp_path / "scratch", []

    def writes(name):
        def phase():
            (scratch / name / "file").write_text("x")
            seen.append(name)
            return {"ok": True}

        return phase

    def raises():
        raise ValueError("broken")

    def not_here():
        raise NotRunHere("needs a GPU")

    phases = {"first": writes("first"), "broken": raises, "elsewhere": not_here, "last": writes("last")}
    figures, out = {}, tmp_path / "figures.json"
    assert not run_phases(phases, figures, out, time.monotonic() + 60, "cpu", scratch=scratch)
    assert seen == ["first", "last"] and figures["first"] == figures["last"] == {"ok": True}
    assert figures["failed"]["broken"]["error"] == "ValueError: broken"
    assert figures["not_run"] == {"elsewhere": "needs a GPU"} and not figures["skipped"]
    assert not any(scratch.iterdir())
    assert json.loads(out.read_text()) == figures

    figures = {}
    assert not run_phases({"last": writes("last")}, figures, out, time.monotonic() + 60, "cpu", ["last"], scratch)
    assert "last" in figures["failed"] and "last" not in figures
    figures = {}
    assert run_phases({"late": writes("late")}, figures, out, time.monotonic() - 1, "cpu")
    assert figures["skipped"] == ["late"] and not figures["failed"]


@pytest.mark.parametrize("module", ["bench.gpu", "bench.gpu_vllm"])
def test_the_checks_document_the_phase_that_can_be_made_to_fail(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "--fail-phase NAME" in done.stdout and "check of the check" in done.stdout
