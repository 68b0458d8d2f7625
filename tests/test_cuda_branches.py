"""The branches that only a GPU takes, executed on the CPU: a recorder stands in for CUDA's driver calls, a dtype
round trip for a device move, a recorder for the vLLM engine and server a GPU node starts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from retool.training import parallel, resident
from retool.training.step import load_model, optimizer_for, update_policy
from retool.weights.checkpoint import Checkpoint
from tests.test_trainer import CONFIG, make_datum

# --- No query that poisons a later fork --------------------------------------------------------------------------


class CudaDriverRecorder:
    """Pretends this CPU build of torch has CUDA with one GPU that NVML sees, and records every call that asks
    CUDA's driver itself (after which a forked process cannot use CUDA)."""

    def __init__(self, monkeypatch) -> None:
        self.driver_calls: list[str] = []
        monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
        for name in ("_cuda_getDeviceCount", "_cuda_init"):
            monkeypatch.setattr(torch._C, name, self._recorded(name), raising=False)
        monkeypatch.setattr(torch.cuda, "_lazy_init", self._recorded("_lazy_init"))

    def _recorded(self, name: str):
        def call(*_args, **_kwargs):
            self.driver_calls.append(name)
            return 1

        return call


def test_the_machine_check_of_a_gpu_run_asks_nvml_not_cuda(monkeypatch, tiny_model_dir, tmp_path):
    """A command on a GPU node checks the machine in the process that later forks Luigi's workers and vLLM's engine
    core: counting the GPUs through CUDA's driver there makes every forked process fail at its first CUDA call."""
    from retool.config.settings import RunSettings
    from retool.run.setup import open_run

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    recorder = CudaDriverRecorder(monkeypatch)
    settings = RunSettings().changed(
        run={"device": "cuda", "runs_dir": str(tmp_path)}, model={"name": str(tiny_model_dir)}, sampler={"engine": "hf"}
    )
    open_run(settings)  # what a command does once, before Luigi forks its workers
    assert recorder.driver_calls == []
    assert torch.cuda.is_available() and recorder.driver_calls == []  # any library's later check asks NVML too


def test_the_vllm_engine_on_a_gpu_starts_its_core_by_spawn_and_text_only(monkeypatch, tmp_path):
    """vLLM forks its engine core unless CUDA is initialised in the process: told to spawn on a GPU. A multimodal
    checkpoint (Qwen3.5's) is served text only, without loading or profiling its vision tower."""
    import sys
    import types

    from retool.sampling import vllm_engine

    started = []

    class RecordingLLM:
        def __init__(self, **options):
            started.append((options, dict(os.environ)))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    engine = vllm_engine.VLLMSampler(tmp_path, "cuda", max_model_len=64)
    engine.llm = None  # nothing to stop
    engine.close()
    options, environment = started[0]
    assert environment["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert options["language_model_only"] is True


# --- The held state moves the object that trains -----------------------------------------------------------------


@pytest.fixture
def one_process_group(tmp_path):
    """A process group of one (gloo), in which the data-parallel wrappers are built as in a group of several."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def datums_of(step: int):
    return [
        make_datum(0, g, list(range(100, 120)), list(range(300 + 10 * g + step, 308 + 10 * g + step)), adv, [-3.0] * 8)
        for g, adv in enumerate([1.0, -1.0])
    ]


def two_steps(model_dir: Path, config, folder: Path, held_between: bool):
    """Two PPO steps; with `held_between`, the state is held and taken back between them as a resident trainer
    does, through float64 in place of the host (a round trip that makes new storage for every tensor, as a move
    between devices does). The second step's logprobs of the first step's datums, and the state after it."""
    model = load_model(model_dir, None, config, "cpu")
    real = parallel.rank_and_world
    parallel.rank_and_world = lambda: (0, 2)  # wrapped as in a group of two; the group itself has one process
    try:
        trained = parallel.data_parallel(model, config, "cpu")
    finally:
        parallel.rank_and_world = real
    optimizer = optimizer_for(model, None, config, "cpu")
    update_policy(trained, optimizer, datums_of(0), config, 2)
    if held_between:
        checkpoint = folder / "checkpoint"
        Checkpoint(checkpoint).marker.parent.mkdir(parents=True)
        Checkpoint(checkpoint).marker.write_text("")
        resident.hold(checkpoint, model_dir, config, model, trained, optimizer, torch.float32, torch.float64)
        held = resident.take(checkpoint, model_dir, config)
        model, trained, optimizer = held.model, held.trained, held.optimizer
    update_policy(trained, optimizer, datums_of(1), config, 2)
    datum = datums_of(0)[0]
    with torch.no_grad():
        logprobs = parallel.logprobs_of(trained)(
            torch.tensor([datum.input_tokens]),
            torch.ones(1, datum.num_tokens, dtype=torch.long),
            torch.tensor([datum.target_tokens]),
        )
    weights = parallel.whole_state(model, None, trained)[0] or model.state_dict()
    return logprobs, {name: value.detach().clone() for name, value in weights.items()}


@pytest.mark.parametrize("kind", ["lora", "ddp", "fsdp"])
def test_a_held_state_taken_back_trains_and_computes_with_its_moved_weights(
    tiny_model_dir, tmp_path, one_process_group, kind
):
    """The step after a held state's round trip computes with the weights it updates, and updates as one whose
    state never moved: FSDP2 gathers from shards its own `_apply` re-points, which moving the inner model skips."""
    config = {
        "lora": CONFIG,
        "ddp": replace(CONFIG, data_parallel="ddp"),
        "fsdp": replace(CONFIG, lora_rank=0, learning_rate=1e-3, data_parallel="fsdp"),
    }[kind]
    stayed_logprobs, stayed = two_steps(tiny_model_dir, config, tmp_path / "stayed", held_between=False)
    moved_logprobs, moved = two_steps(tiny_model_dir, config, tmp_path / "moved", held_between=True)
    assert stayed.keys() == moved.keys()
    for name in stayed:
        torch.testing.assert_close(moved[name], stayed[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(moved_logprobs, stayed_logprobs, rtol=0, atol=1e-5)
    # ...and its forward pass is the function of the weights it holds
    if kind == "fsdp":
        plain = load_model(tiny_model_dir, None, config, "cpu")
        datum = datums_of(0)[0]
        with torch.no_grad():
            expected = torch.func.functional_call(
                parallel.TokenLogprobs(plain),
                {f"policy.{name}": value for name, value in moved.items()},
                (
                    torch.tensor([datum.input_tokens]),
                    torch.ones(1, datum.num_tokens, dtype=torch.long),
                    torch.tensor([datum.target_tokens]),
                ),
                strict=False,
            )
        torch.testing.assert_close(moved_logprobs, expected, rtol=0, atol=1e-5)


# --- The optimizer and the precision a GPU step trains in ---------------------------------------------------------


def test_adam_on_cuda_is_one_fused_kernel(monkeypatch, tiny_model_dir):
    """On CUDA Adam's default (foreach) allocates temporaries the size of every trained weight, which the memory
    plan does not hold: the fused kernel allocates none."""
    made = []
    monkeypatch.setattr(torch.optim, "Adam", lambda parameters, **options: made.append(options))
    model = load_model(tiny_model_dir, None, CONFIG, "cpu")
    optimizer_for(model, None, CONFIG, "cuda")
    optimizer_for(model, None, CONFIG, "cpu")
    assert made[0]["fused"] is True and "fused" not in made[1]


def test_fsdp2_gathers_in_bfloat16_reduces_in_float32_without_autocast(tiny_model_dir, one_process_group):
    """A sharded full fine-tune under autocast_bfloat16: FSDP2's mixed-precision policy casts each gathered layer to
    bfloat16 (no autocast re-casting every weight at every product) and reduces the gradients into float32 shards."""
    config = replace(CONFIG, lora_rank=0, data_parallel="fsdp", autocast_bfloat16="true")
    model = load_model(tiny_model_dir, None, config, "cpu")
    real = parallel.rank_and_world
    parallel.rank_and_world = lambda: (0, 2)
    try:
        trained = parallel.data_parallel(model, config, "cpu")
    finally:
        parallel.rank_and_world = real
    seen = []
    projection = model.model.layers[0].self_attn.q_proj
    projection.register_forward_pre_hook(
        lambda module, _: seen.append((module.weight.dtype, torch.is_autocast_enabled()))
    )
    optimizer = optimizer_for(model, None, config, "cpu")
    update_policy(trained, optimizer, datums_of(0), config, 2)
    assert seen and all(entry == (torch.bfloat16, False) for entry in seen)
    trained.reshard()  # the outermost unit keeps its weights gathered after a forward pass
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards Adam updates
    assert {value.dtype for state in optimizer.state.values() for value in state.values()} == {torch.float32}


def test_a_training_groups_idle_processes_wait_for_the_next_step_on_the_host(monkeypatch, tmp_path, one_process_group):
    """While the command samples, the group's other processes wait for the next request: in a gloo group, on the CPU,
    not in an NCCL broadcast whose kernel spins on a GPU that a vLLM server shares."""
    from retool.training import worker
    from retool.training.group import REQUEST

    waited_on = []
    monkeypatch.setattr(worker, "_die_with_parent", lambda: None)
    monkeypatch.setattr(
        dist, "broadcast_object_list", lambda objects, src, group=None: waited_on.append(group) or objects
    )
    (tmp_path / REQUEST).write_text(json.dumps({"stop": True}))
    worker.serve_steps(tmp_path, parent=os.getpid(), hold_on="", device="cpu")
    assert waited_on and all(group is not None and dist.get_backend(group) == "gloo" for group in waited_on)


# --- The servers' sleep while a step trains ----------------------------------------------------------------------


class RecordingServer:
    """Answers a ServerSampler's calls as a vLLM server in sleep mode would, recording each."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.asleep = False

    def __call__(self, method: str, url: str, path: str, timeout: float, **kwargs) -> dict:
        rpc = kwargs.get("json", {})
        self.calls.append((method, path, rpc.get("kwargs", {}).get("weights_path")) if rpc else (method, path))
        if path.startswith("/sleep"):
            self.asleep = True
        elif path in ("/wake_up", "/wake_up?tags=kv_cache"):
            self.asleep = False
        return {"data": [{"id": "base", "parent": None}]} if path == "/v1/models" else {"is_sleeping": self.asleep}


@pytest.mark.parametrize("full_weights", [True, False])
def test_a_server_sleeps_at_the_level_its_weights_need_and_wakes_into_the_next_policy(monkeypatch, full_weights):
    """Full weights are dropped (level 2: copying them to the host and back costs two transfers of the model, then
    the next policy overwrites them) and the next policy is loaded into the woken weights before the KV cache takes
    its memory; a LoRA's base, which it keeps serving, goes to the host (level 1)."""
    from retool.sampling import server_client
    from retool.weights.checkpoint import Policy

    server = RecordingServer()
    monkeypatch.setattr(server_client, "_call", server)
    sampler = server_client.ServerSampler("http://gpu:8000", "cuda", full_weights=full_weights)
    server.calls.clear()
    sampler.sleep()
    if full_weights:
        sampler.use_policy(Policy(Path("step0/model")))
    else:
        sampler.wake()  # the step's end (reclaim_sampler_memory); the adapter is loaded when the next round samples
    sampler.close()
    if full_weights:
        assert server.calls == [
            ("POST", "/sleep?level=2"),
            ("GET", "/is_sleeping"),
            ("POST", "/wake_up?tags=weights"),
            ("POST", "/collective_rpc", "step0/model"),
            ("POST", "/wake_up?tags=kv_cache"),
            ("POST", "/reset_prefix_cache"),
        ]
    else:
        assert server.calls == [("POST", "/sleep?level=1"), ("POST", "/wake_up")]


def test_a_server_put_to_sleep_by_another_process_is_woken_into_this_ones_weights(monkeypatch):
    """Every worker process has its own client of a server: one that finds it asleep at level 2 (another process's
    training step dropped its weights) loads the weights it samples with again, even the same policy as before."""
    from retool.sampling import server_client
    from retool.weights.checkpoint import Policy

    server = RecordingServer()
    monkeypatch.setattr(server_client, "_call", server)
    sampler = server_client.ServerSampler("http://gpu:8000", "cuda", full_weights=True)
    sampler.use_policy(Policy(Path("step0/model")))
    server.asleep = True  # another process's step
    server.calls.clear()
    sampler.wake()
    sampler.close()
    assert ("POST", "/collective_rpc", "step0/model") in server.calls


def test_an_8_gpu_node_gives_each_server_64_sequences_to_decode_text_only():
    """configs/node8.cfg layered on luigi.cfg, as LUIGI_CONFIG_PATH does: each server decodes at least 64 sequences
    of a step at once (8 would leave it bound by reading its weights), and serves the text model only."""
    from retool.config.files import settings_from_files
    from retool.sampling.server import server_command
    from tests.helpers import REPO

    settings = settings_from_files([REPO / "luigi.cfg", REPO / "configs" / "node8.cfg"])
    sequences = settings.data.questions_per_step * settings.rollout.group_size
    assert sequences // settings.sampler.engines >= 64 and settings.rollout.shards % settings.sampler.engines == 0
    assert "--language-model-only" in server_command(settings.changed(model={"name": "default"}), 8000)
