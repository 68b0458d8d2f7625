"""PPO trainer on a tiny model with hand-made datums."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file

from retool.config.trainer import TrainerConfig
from retool.files.tables import DATUMS, table_from_rows, write_table_atomically
from retool.rollout.datums import Datum, datums_from_table
from retool.training.checkpoints import prune_checkpoints, save_checkpoint
from retool.training.losses import token_logprobs
from retool.training.packing import loss_token_weights, pack_micro_batches
from retool.training.resume import StepInputs
from retool.training.step import accumulate_gradients, load_policy, update_policy

CONFIG = TrainerConfig(
    lora_rank=8, lora_alpha=16, learning_rate=5e-3, gradient_checkpointing=False, autocast_bfloat16="false"
).on("cpu")


def make_datum(question, group, prompt, completion, advantage, old_logprobs, observation=(), second=()):
    """prompt + completion (+ observation + second completion), shifted right like build_datum."""
    tokens = list(prompt) + list(completion) + list(observation) + list(second)
    action = [False] * len(prompt) + [True] * len(completion) + [False] * len(observation) + [True] * len(second)
    old = [0.0] * len(prompt) + list(old_logprobs) + [0.0] * (len(observation) + len(second))
    return Datum(
        question, group, tokens[:-1], tokens[1:], old[1:], [advantage if a else 0.0 for a in action[1:]], action[1:]
    )


def datum_logprobs(model, datum) -> torch.Tensor:
    """The model's logprob of each of the datum's targets (no gradient)."""
    with torch.no_grad():
        return token_logprobs(
            model,
            torch.tensor(datum.input_tokens)[None],
            torch.ones(1, datum.num_tokens, dtype=torch.long),
            torch.tensor(datum.target_tokens)[None],
        )[0]


def sequence_logprob(model, datum):
    return float(datum_logprobs(model, datum)[torch.tensor(datum.loss_mask)].sum())


def on_policy_datums(model):
    """Two completions of one prompt, old logprobs taken from the model itself."""
    prompt = list(range(200, 230))
    datums = []
    for group, (completion, advantage) in enumerate([(list(range(300, 312)), 1.0), (list(range(400, 412)), -1.0)]):
        draft = make_datum(0, group, prompt, completion, advantage, [0.0] * len(completion))
        logprobs = datum_logprobs(model, draft).tolist()
        old = [lp if m else 0.0 for lp, m in zip(logprobs, draft.loss_mask)]
        datums.append(replace(draft, old_logprobs=old))
    return datums


def test_one_step_raises_positive_and_lowers_negative_completions(tiny_model_dir):
    model, optimizer = load_policy(tiny_model_dir, None, CONFIG)
    datums = on_policy_datums(model)
    before = [sequence_logprob(model, d) for d in datums]
    metrics = update_policy(model, optimizer, datums, CONFIG, num_trajectories=2)
    after = [sequence_logprob(model, d) for d in datums]
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics.datums == 2 and metrics.loss_tokens == 24 and not metrics.skipped
    assert metrics.logprob_gap < 1e-5 and metrics.clip_fraction == 0.0  # on-policy: ratio 1
    assert metrics.grad_norm > 0


def test_observation_tokens_never_reach_the_gradient(tiny_model_dir):
    prompt, first, observation, second = (
        list(range(200, 220)),
        list(range(300, 306)),
        list(range(500, 510)),
        list(range(600, 606)),
    )
    datum = make_datum(0, 0, prompt, first, 1.0, [-2.0] * 6, observation, second)
    # The same datum, with nonsense advantages and logprobs on the observation tokens only.
    noisy = replace(
        datum,
        advantages=[a if m else 7.0 for a, m in zip(datum.advantages, datum.loss_mask)],
        old_logprobs=[o if m else -9.0 for o, m in zip(datum.old_logprobs, datum.loss_mask)],
    )
    results = []
    for variant in (datum, noisy):
        model, optimizer = load_policy(tiny_model_dir, None, CONFIG)
        update_policy(model, optimizer, [variant], CONFIG, num_trajectories=1)
        results.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    assert all(torch.equal(results[0][name], results[1][name]) for name in results[0])


@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean"])
def test_accumulated_micro_batch_gradients_equal_one_batch(tiny_model_dir, aggregation):
    config = replace(CONFIG, loss_aggregation=aggregation)
    model, _ = load_policy(tiny_model_dir, None, config)
    datums = on_policy_datums(model) + [make_datum(1, 0, list(range(100, 150)), list(range(700, 709)), 0.5, [-3.0] * 9)]
    weights = loss_token_weights([d.loss_tokens for d in datums], aggregation, num_samples=5)
    gradients = []
    for batches in (
        pack_micro_batches([d.num_tokens for d in datums], 1, 10_000),
        pack_micro_batches([d.num_tokens for d in datums], 10, 10_000),
    ):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, datums, batches, weights, config)
        gradients.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert len(pack_micro_batches([d.num_tokens for d in datums], 1, 10_000)) == 3
    for split, whole in zip(*gradients):
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_packing_is_first_fit_decreasing_within_bounds():
    lengths = [50, 10, 40, 30, 20, 60, 5]
    batches = pack_micro_batches(lengths, max_items=3, max_padded_tokens=120)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lengths)))
    assert all(len(b.indices) <= 3 and b.padded_tokens <= 120 for b in batches)
    assert batches[0].indices[0] == 5  # the longest goes first
    assert sum(b.padded_tokens for b in batches) >= sum(lengths)
    assert pack_micro_batches([500], 4, 100)[0].indices == (0,)  # too long: alone


def loss_token_distributions(model, datums):
    """Log-softmax over the vocabulary at each loss token, and the targets there, from a plain forward pass."""
    rows = []
    with torch.no_grad():
        for datum in datums:
            logits = model(input_ids=torch.tensor([datum.input_tokens])).logits[0].float()
            mask = torch.tensor(datum.loss_mask)
            rows.append((torch.log_softmax(logits, dim=-1)[mask], torch.tensor(datum.target_tokens)[mask]))
    return rows


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_entropy_and_kl_of_a_step_match_a_direct_computation(tiny_model_dir, mini_batches):
    config = replace(CONFIG, ppo_mini_batches=mini_batches)
    model, optimizer = load_policy(tiny_model_dir, None, config)
    datums = on_policy_datums(model)
    before = loss_token_distributions(model, datums)
    metrics = update_policy(model, optimizer, datums, config, num_trajectories=2)
    after = loss_token_distributions(model, datums)
    entropy = torch.cat([-(lp.exp() * lp).sum(-1) for lp, _ in before]).mean()
    chosen = [torch.cat([lp.gather(-1, t[:, None])[:, 0] for lp, t in rows]) for rows in (before, after)]
    log_ratio = chosen[1] - chosen[0]
    assert metrics.updates == mini_batches and metrics.loss_tokens == 24
    assert metrics.entropy == pytest.approx(float(entropy), rel=1e-4)  # of the policy before any update
    assert metrics.kl_k1 == pytest.approx(float(-log_ratio.mean()), rel=1e-3, abs=1e-7)
    assert metrics.kl_k3 == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).mean()), rel=1e-3, abs=1e-8)
    assert metrics.kl_k3 > 1e-4  # the step moved the policy (lr 5e-3)
    outside = ((log_ratio.exp() < 0.8) | (log_ratio.exp() > 1.28)).float().mean()
    assert metrics.ratio_outside_clip == pytest.approx(float(outside))
    assert metrics.logprob_gap < 1e-5  # the datums' old logprobs are the policy's own


@pytest.mark.parametrize("shift", [-1.0, 1.0])
def test_the_kl_penalty_alone_moves_each_sampled_token_toward_the_reference(tiny_model_dir, shift):
    """With zero advantages only [trainer] kl_coef's penalty acts: a reference that finds the sampled tokens less
    (more) likely than the policy does lowers (raises) them, and the step records the KL it started from."""
    config = replace(CONFIG, kl_coef=1.0)
    model, optimizer = load_policy(tiny_model_dir, None, config)
    datums = [
        replace(
            d,
            advantages=[0.0] * d.num_tokens,
            reference_logprobs=[lp + shift if m else 0.0 for lp, m in zip(d.old_logprobs, d.loss_mask)],
        )
        for d in on_policy_datums(model)
    ]
    before = [sequence_logprob(model, d) for d in datums]
    metrics = update_policy(model, optimizer, datums, config, num_trajectories=2)
    after = [sequence_logprob(model, d) for d in datums]
    assert all((a - b) * shift > 0.01 for a, b in zip(after, before))
    k3 = torch.tensor(shift).exp() - 1 - shift  # every token: log reference / policy = shift
    assert metrics.kl_reference == pytest.approx(float(k3), rel=1e-4)
    assert metrics.loss == pytest.approx(float(k3), rel=1e-4)  # token_mean of the penalty alone


def test_later_mini_batches_are_off_policy_and_the_clip_bounds_them(tiny_model_dir):
    config = replace(CONFIG, learning_rate=3e-2, ppo_mini_batches=2, ppo_epochs=2)
    model, optimizer = load_policy(tiny_model_dir, None, config)
    metrics = update_policy(model, optimizer, on_policy_datums(model), config, num_trajectories=2)
    assert metrics.updates == 4 and metrics.clip_fraction > 0  # the first update moved the policy past the clip
    assert metrics.ratio_outside_clip > 0


def test_loss_weights_give_the_documented_means():
    assert loss_token_weights([2, 4], "sample_mean", 4) == [1 / 8, 1 / 16]
    assert loss_token_weights([2, 4], "token_mean", 4) == [1 / 6, 1 / 6]


def test_a_step_without_datums_skips_the_update(tiny_model_dir):
    model, optimizer = load_policy(tiny_model_dir, None, CONFIG)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    metrics = update_policy(model, optimizer, [], CONFIG, num_trajectories=8)
    assert metrics.skipped and metrics.datums == 0
    assert all(torch.equal(a, b) for a, b in zip(before, [p for p in model.parameters() if p.requires_grad]))


def test_full_fine_tune_and_checkpoint_round_trip(tiny_model_dir, tmp_path):
    for config in (CONFIG, replace(CONFIG, lora_rank=0, learning_rate=1e-4)):
        model, optimizer = load_policy(tiny_model_dir, None, config)
        metrics = update_policy(model, optimizer, on_policy_datums(model), config, num_trajectories=2)
        folder = tmp_path / f"rank{config.lora_rank}" / "checkpoint"
        save_checkpoint(folder, model, optimizer, metrics, config, tiny_model_dir)
        assert (folder / "_SUCCESS").exists() and json.loads((folder / "metrics.json").read_text())["datums"] == 2
        restored, restored_optimizer = load_policy(tiny_model_dir, folder, config)
        for (name, a), (_, b) in zip(model.named_parameters(), restored.named_parameters()):
            torch.testing.assert_close(a, b, msg=name)
        assert restored_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_retention_keeps_the_newest_and_every_nth(tmp_path):
    folders = []
    for step in range(6):
        folder = tmp_path / f"step={step:04d}" / "checkpoint"
        (folder / "adapter").mkdir(parents=True)
        (folder / "optimizer.pt").write_text("x")
        (folder / "_SUCCESS").write_text("")
        folders.append((step, folder))
    prune_checkpoints(folders, keep_last=2, keep_every=3)
    kept = [step for step, folder in folders if (folder / "adapter").exists()]
    assert kept == [0, 3, 4, 5]
    assert all((folder / "_SUCCESS").exists() for _, folder in folders)


@pytest.mark.slow
@pytest.mark.parametrize(
    "data_parallel, lora_rank, kl_coef",
    [
        ("ddp", CONFIG.lora_rank, 0.0),
        ("fsdp", CONFIG.lora_rank, 0.0),
        ("ddp", 0, 0.0),
        ("fsdp", 0, 0.0),
        ("fsdp", 0, 5.0),
    ],
    ids=["ddp-lora", "fsdp-lora", "ddp-full", "fsdp-full", "fsdp-full-kl"],
)
def test_two_processes_give_the_same_parameters_as_one(tiny_model_dir, tmp_path, lora_rank, data_parallel, kl_coef):
    """Under torchrun, DDP or FSDP2 sums the two processes' gradients: two steps, the second from the first's
    checkpoint (FSDP2: its weights and Adam state gathered to be saved, and sharded again as they load), equal
    one process's; with a KL penalty, each process's share of the base's logprobs joined into every datum's."""
    model, _ = load_policy(tiny_model_dir, None, CONFIG)
    datums = on_policy_datums(model) + [
        make_datum(1, g, list(range(100, 140)), list(range(700 + g, 710 + g)), 0.5 - g, [-3.0] * 10) for g in range(3)
    ]
    rows = [{"step": 0, **{k: v for k, v in asdict(d).items()}, "num_tokens": d.num_tokens} for d in datums]
    write_table_atomically(table_from_rows(rows, DATUMS), tmp_path / "datums.parquet")
    assert len(datums) % 2  # one datum per micro-batch: one process has one fewer and repeats one at zero weight
    config = replace(CONFIG, micro_batch_items=1, lora_rank=lora_rank, data_parallel=data_parallel, kl_coef=kl_coef)
    worker = ["-m", "retool.training.worker", "--inputs"]
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]
    for name, command in (("one", worker), ("two", [*torchrun, *worker])):
        for step, previous in ((0, None), (1, tmp_path / f"{name}0")):
            inputs = StepInputs(
                tiny_model_dir, (tmp_path / "datums.parquet",), 6, 0, previous, tmp_path / f"{name}{step}", config
            )
            (tmp_path / f"{name}{step}.json").write_text(inputs.to_json())
            subprocess.run(
                [sys.executable, *command, str(tmp_path / f"{name}{step}.json")], check=True, capture_output=True
            )
    weights = "adapter/adapter_model.safetensors" if lora_rank else "model/model.safetensors"
    one, two = (load_file(tmp_path / f"{name}1" / weights) for name in ("one", "two"))
    assert one.keys() == two.keys()
    # Equal up to the order of float sums, which Adam magnifies where a gradient is near 0; Adam's state lost or
    # misplaced on the way would move weights by about the learning rate (5e-3) in the second step.
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=1e-4, msg=name)
    one_metrics, two_metrics = (json.loads((tmp_path / f"{n}1" / "metrics.json").read_text()) for n in ("one", "two"))
    assert two_metrics["loss_tokens"] == one_metrics["loss_tokens"]
    assert two_metrics["kl_reference"] == pytest.approx(one_metrics["kl_reference"], rel=1e-3)
    assert (one_metrics["kl_reference"] > 1e-6) == bool(kl_coef)
    assert len(datums_from_table(pq_read(tmp_path / "datums.parquet"))) == len(datums)


def pq_read(path):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def test_the_shipped_ppo_settings_are_the_seeds_recipe():
    from retool.config.settings import RunSettings

    config = RunSettings().trainer_on_device()
    assert (1 - config.clip_low, 1 + config.clip_high) == (0.8, 1.28)
    assert (config.learning_rate, config.beta1, config.beta2, config.objective) == (4e-5, 0.9, 0.95, "ppo")


def test_the_ratio_is_clipped_to_the_shipped_range():
    from retool.training.losses import ppo_token_loss

    config = TrainerConfig()
    ratios = torch.tensor([0.5, 0.9, 1.1, 1.5])
    for advantage in (1.0, -1.0):
        logprobs = torch.log(ratios).requires_grad_()
        loss, clipped = ppo_token_loss(logprobs, torch.zeros(4), torch.full((4,), advantage), config)
        loss.sum().backward()
        # A gain is capped at 1.28, a loss at 0.8 (and the unclipped side keeps its gradient).
        expected_clipped = [False, False, False, True] if advantage > 0 else [True, False, False, False]
        assert clipped.tolist() == expected_clipped
        assert [g == 0 for g in logprobs.grad.tolist()] == expected_clipped
        assert loss.tolist()[3 if advantage > 0 else 0] == pytest.approx(-advantage * (1.28 if advantage > 0 else 0.8))


def test_filtering_zero_variance_groups_averages_over_datums_only(tiny_model_dir):
    datums = on_policy_datums(load_policy(tiny_model_dir, None, CONFIG)[0])
    datums = [replace(d, advantages=[abs(a) for a in d.advantages]) for d in datums]  # same sign: a non-zero loss
    losses = {}
    for filtered in (False, True):
        config = replace(
            CONFIG, loss_aggregation="sample_mean", filter_zero_variance_groups=filtered, learning_rate=1e-9
        )
        model, optimizer = load_policy(tiny_model_dir, None, config)
        losses[filtered] = update_policy(model, optimizer, datums, config, num_trajectories=10).loss
    assert losses[True] == pytest.approx(losses[False] * 5, rel=1e-4)  # 2 datums of 10 trajectories


def step_gradients(tiny_model_dir, config):
    """Loss and LoRA gradients of one accumulation over the on-policy datums."""
    model, _ = load_policy(tiny_model_dir, None, config)
    datums = on_policy_datums(model)
    batches = pack_micro_batches([d.num_tokens for d in datums], config.micro_batch_items, config.micro_batch_tokens)
    weights = loss_token_weights([d.loss_tokens for d in datums], config.loss_aggregation, len(datums))
    datums = [
        replace(d, old_logprobs=[v - 0.1 if m else 0.0 for v, m in zip(d.old_logprobs, d.loss_mask)]) for d in datums
    ]
    seen = accumulate_gradients(model, datums, batches, weights, config)
    gradients = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.requires_grad}
    return seen.loss, gradients


def test_chunked_logprobs_and_checkpointing_give_the_same_loss_and_gradients(tiny_model_dir):
    loss, gradients = step_gradients(tiny_model_dir, CONFIG)
    for variant in (replace(CONFIG, logprob_chunk_tokens=5), replace(CONFIG, gradient_checkpointing=True)):
        other_loss, other_gradients = step_gradients(tiny_model_dir, variant)
        assert other_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        for name, gradient in gradients.items():
            torch.testing.assert_close(other_gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_bfloat16_gives_close_losses_and_gradients(tiny_model_dir):
    loss, gradients = step_gradients(tiny_model_dir, CONFIG)
    low_loss, low_gradients = step_gradients(tiny_model_dir, replace(CONFIG, dtype="bfloat16"))
    assert low_loss == pytest.approx(loss, rel=0.05, abs=1e-3)
    for name, gradient in gradients.items():
        cosine = torch.nn.functional.cosine_similarity(low_gradients[name].flatten(), gradient.flatten(), dim=0)
        assert gradient.abs().max() == 0 or cosine > 0.95, name


def test_the_trainer_dtype_follows_the_device_and_the_policy():
    from retool.config.settings import RunConfig, RunSettings, frozen

    on_gpu, on_cpu = RunSettings(run=RunConfig(device="cuda")), RunSettings(run=RunConfig(device="cpu"))
    assert on_gpu.trainer_on_device().dtype == "bfloat16" and on_gpu.trainer_on_device().gradient_checkpointing
    assert on_gpu.trainer_on_device().autocast_bfloat16 == "true"  # LoRA's float32 adapters multiply in bfloat16
    assert on_cpu.trainer_on_device().dtype == "float32" and not on_cpu.trainer_on_device().gradient_checkpointing
    assert frozen(on_cpu)["trainer"]["dtype"] == "float32"  # runs frozen before "auto" still match
    # A full fine-tune keeps float32 master weights and Adam state on a GPU too, and so does a full cold start
    # before LoRA RL: only a LoRA's frozen base is held in bfloat16.
    full = on_gpu.changed(trainer={"lora_rank": 0})
    assert full.trainer_on_device().dtype == "float32" and full.trainer_on_device().autocast_bfloat16 == "true"
    assert on_gpu.changed(cold_start={"lora_rank": 0}).sft_trainer().dtype == "float32"


def test_a_full_fine_tune_in_bfloat16_compute_changes_every_weight_at_a_small_learning_rate(tiny_model_dir):
    """Mixed precision: float32 weights and Adam state, products in bfloat16 (autocast), take Adam's first step of
    lr 1e-5 on every weight; weights held in bfloat16 lose it wherever it is below half a unit in the last place."""

    from bench.gpu import share_updated

    def changed_fraction(config: TrainerConfig) -> float:
        model, optimizer = load_policy(tiny_model_dir, None, config)
        before = [p.detach().clone() for p in model.parameters()]
        update_policy(model, optimizer, on_policy_datums(model), config, num_trajectories=2)
        return share_updated(model, optimizer, before)

    full = TrainerConfig(lora_rank=0, learning_rate=1e-5, gradient_checkpointing=False, autocast_bfloat16="true").on(
        "cpu"
    )
    mixed = changed_fraction(full)  # dtype auto: float32 master weights
    pure = changed_fraction(replace(full, dtype="bfloat16"))
    assert mixed >= 0.99 and pure < 0.5, (mixed, pure)


def test_auto_sampler_on_a_gpu_without_vllm_fails_loudly(monkeypatch):
    import retool.sampling.engines
    from retool.config.sampler import SamplerConfig
    from retool.config.settings import RunConfig, RunSettings, SettingsError

    monkeypatch.setattr(retool.sampling.engines, "vllm_available", lambda: False)
    on_gpu = RunSettings(run=RunConfig(device="cuda"))
    with pytest.raises(SettingsError, match="engine = auto on device = cuda needs vLLM"):
        retool.sampling.engines.sampler_kind(on_gpu)
    assert retool.sampling.engines.sampler_kind(replace(on_gpu, sampler=SamplerConfig("hf"))) == "hf"
