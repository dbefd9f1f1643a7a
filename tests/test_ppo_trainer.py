"""PPO and reward-model trainers on a tiny real stack: invariants, resume, options, and a broken-sign check."""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import replace

import pandas as pd
import pytest
import torch

from rlhf.config import DataConfig, PPOConfig, RewardConfig, RuntimeConfig, SFTConfig, TrackingConfig
from rlhf.data import synthetic
from rlhf.data.prepare import prepare_preferences
from rlhf.errors import TrainingInterrupted as RMInterrupted
from rlhf.models.bootstrap import build_tiny_gpt2, build_tokenizer
from rlhf.models.loading import load_causal_lm
from rlhf.ops import GAEOutput
from rlhf.ppo import optimise as ppo_optimise
from rlhf.ppo import update as ppo_update
from rlhf.ppo.models import load_models
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.run import PolicyInputs, PolicyRun
from rlhf.ppo.state import load_state
from rlhf.ppo.trainer import TrainingInterrupted, generation_settings, train_ppo
from rlhf.rollout.batching import encode_prompts
from rlhf.train.reward import train_reward_model
from rlhf.train.sft import bootstrap_sft

# one xdist worker runs the module: its tests share the trained stack (a module fixture of about 15 s)
pytestmark = pytest.mark.xdist_group("ppo_trainer")
RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics: the tolerances below
NOT_DETERMINISTIC = ("time/", "speed/", "memory/")


def _nolog(metrics, step):
    pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A small trained SFT policy and reward model on the synthetic task (about 15 s on 2 cores)."""
    root = tmp_path_factory.mktemp("stack")
    data = prepare_preferences(
        DataConfig(synthetic={"n_sft": 1500, "n_train_pairs": 1200, "n_eval_pairs": 200}), root / "data"
    )
    sft_cfg = SFTConfig(
        steps=250, warmup_ratio=0.12, batch_size=64, bootstrap={"n_layer": 2, "n_embd": 64, "vocab_size": 320}
    )
    sft = bootstrap_sft(sft_cfg, RUNTIME, data.sft, data.train, root / "sft", 0, _nolog)
    rm_cfg = RewardConfig(epochs=2, batch_size=32, lr=1e-3, eval_every=20, save_every=10)
    rm_logged: dict[int, dict[str, float]] = {}  # step -> metrics: the uninterrupted run the resume test compares with
    rm = train_reward_model(
        rm_cfg, RUNTIME, sft.path, data.train, data.eval, root / "rm", 0, lambda m, s: rm_logged.__setitem__(s, m)
    )
    prompts = sorted(set(pd.read_parquet(data.train)["prompt"]))
    return {
        "root": root,
        "data": data,
        "sft": sft.path,
        "rm": rm.path,
        "prompts": prompts,
        "rm_cfg": rm_cfg,
        "rm_metrics": rm.metrics,
        "rm_logged": rm_logged,
    }


def _train(stack, cfg: PPOConfig, folder, log, reward: str | None = "rm", **kw):
    """train_ppo on the module's stack (SFT policy, reward model unless `reward` is None, prompts), seed 0."""
    rm = stack[reward] if reward else None
    return train_ppo(PolicyRun(cfg, RUNTIME, stack["sft"], rm, stack["prompts"], folder, 0, log, **kw))


def _cfg(**kw) -> PPOConfig:
    base = dict(
        total_episodes=64,
        batch_size=16,
        num_mini_batches=2,
        num_ppo_epochs=2,
        max_new_tokens=12,
        save_every=100,
        record_rollouts=False,
    )
    return PPOConfig(**{**base, **kw})


def _rollout(stack, cfg: PPOConfig, dtype: torch.dtype = torch.float32):
    runtime = RUNTIME.model_copy(update={"dtype": str(dtype).removeprefix("torch.")})
    m = load_models(cfg, runtime, stack["sft"], stack["rm"], stack["rm"], torch.device("cpu"))
    state = load_state(stack["root"] / "no-state", m, cfg, 0, torch.device("cpu"))
    ids = encode_prompts(m.tokenizer, stack["prompts"], cfg.max_prompt_tokens)
    batch = prompt_batch(ids, 0, cfg.batch_size, 0, m.tokenizer.pad_token_id)
    plan = ExecutionPlan.for_models(m, dtype)
    settings = generation_settings(cfg, m)
    r = ppo_update.generate_and_score(m, batch, stack["prompts"], cfg, settings, state.sample_generator, plan)
    ppo_update.compute_advantages(r, cfg, state.kl_ctl.value)
    return m, state, r


@pytest.mark.parametrize(
    ("temperature", "dtype"), [(1.0, torch.float32), (0.7, torch.float32), (0.7, torch.bfloat16)]
)  # bfloat16: CPU autocast, the reference's matmul weights and the reward model in bf16, the bf16 fused LM head
def test_first_minibatch_ratio_is_exactly_one(stack, temperature, dtype):
    # forward_batch_size 5 != minibatch 8: the no-grad pass is chunked differently from the optimisation pass
    cfg = _cfg(temperature=temperature, forward_batch_size=5)
    m, state, r = _rollout(stack, cfg, dtype)
    if dtype == torch.bfloat16:
        reference = dict(m.reference.named_parameters())
        assert reference["transformer.h.0.attn.c_attn.weight"].dtype == torch.bfloat16  # autocast's matmul dtype
        assert reference["transformer.wte.weight"].dtype == torch.float32  # looked up, and tied to the LM head
        assert next(m.reward.parameters()).dtype == torch.bfloat16
        assert next(m.policy.parameters()).dtype == torch.float32  # master weights
    # the reference computes what the policy computes: the KL at identical weights is exactly 0
    assert torch.equal(r.scored.logprobs, r.scored.ref_logprobs)
    result = ppo_optimise.optimize(m, state, r, cfg, ExecutionPlan.for_models(m, dtype))
    first = result.minibatch_stats[0]
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["policy/clipfrac"] == 0.0
    assert first["policy/approxkl"] < 1e-10
    assert first["value/clipfrac"] == 0.0
    # later minibatches moved the policy: the statistics are live, not constants
    assert any(s["policy/approxkl"] > 0 for s in result.minibatch_stats[1:])


def test_padding_columns_left_out_of_the_optimisation_change_nothing(stack, monkeypatch):
    """The optimisation's micro-batches drop the columns that are padding in all their rows; the statistics and the
    updated weights equal those of the same update over the rollout's full width."""
    cfg = _cfg(max_new_tokens=16)
    m, state, r = _rollout(stack, cfg)
    lengths = r.scored.resp.mask.sum(1)
    assert lengths.min() < lengths.max() and bool((r.scored.qr_mask[:, 0] == 0).any())  # ragged: something to trim
    trimmed = [ppo_optimise.micro_batch(r, torch.arange(i, i + 8)) for i in (0, 8)]
    assert any(mb.query_responses.shape[1] < r.scored.query_responses.shape[1] for mb in trimmed)
    weights = copy.deepcopy({"policy": m.policy.state_dict(), "value": m.value.state_dict()})
    optim_states = copy.deepcopy((state.policy_opt.state_dict(), state.value_opt.state_dict()))
    shuffle = state.shuffle_generator.get_state()
    ours = ppo_optimise.optimize(m, state, r, cfg, ExecutionPlan.for_models(m))
    after = {"policy": m.policy.state_dict(), "value": m.value.state_dict()}
    after = copy.deepcopy(after)

    def full_width(rollout, rows):
        scored = rollout.scored
        return ppo_optimise.MicroBatch(
            scored.query_responses[rows], scored.qr_mask[rows], scored.prompt_len, rollout.mask[rows],
            scored.logprobs[rows], rollout.loss_advantages[rows], scored.values[rows], rollout.returns[rows],
            scored.ref_logprobs[rows],
        )  # fmt: skip

    m.policy.load_state_dict(weights["policy"])
    m.value.load_state_dict(weights["value"])
    state.policy_opt.load_state_dict(optim_states[0])
    state.value_opt.load_state_dict(optim_states[1])
    state.shuffle_generator.set_state(shuffle)
    monkeypatch.setattr(ppo_optimise, "micro_batch", full_width)
    reference = ppo_optimise.optimize(m, state, r, cfg, ExecutionPlan.for_models(m))
    for a, b in zip(ours.minibatch_stats, reference.minibatch_stats, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for name, tensors in (("policy", m.policy.state_dict()), ("value", m.value.state_dict())):
        for key, value in tensors.items():
            torch.testing.assert_close(after[name][key], value, atol=1e-5, rtol=1e-4)


def test_a_second_thread_gives_the_update_of_one_thread(stack, monkeypatch):
    """With two torch threads on the CPU, the optimisation runs the policy side and the value side of each
    micro-batch at once in two threads, each op single-threaded (threads.use_second_thread); the statistics and the
    updated weights are those of the same update on one thread, one side after the other, bit for bit. Checked
    explicitly because `make test`'s pytest-xdist workers give torch one thread (tests/conftest.py): the other tests
    take the one-thread path there."""
    cfg = _cfg()
    m, state, r = _rollout(stack, cfg)
    weights = copy.deepcopy({"policy": m.policy.state_dict(), "value": m.value.state_dict()})
    optim_states = copy.deepcopy((state.policy_opt.state_dict(), state.value_opt.state_dict()))
    shuffle = state.shuffle_generator.get_state()
    value_threads: list[str] = []
    real = ppo_optimise._value_micro

    def spy(*args, **kwargs):
        value_threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(ppo_optimise, "_value_micro", spy)
    results = {}
    for threads in (1, 2):
        m.policy.load_state_dict(weights["policy"])
        m.value.load_state_dict(weights["value"])
        state.policy_opt.load_state_dict(optim_states[0])
        state.value_opt.load_state_dict(optim_states[1])
        state.shuffle_generator.set_state(shuffle)
        value_threads.clear()
        torch.set_num_threads(threads)  # the autouse fixture of tests/conftest.py restores the worker's count
        result = ppo_optimise.optimize(m, state, r, cfg, ExecutionPlan.for_models(m))
        assert torch.get_num_threads() == threads  # torch_threads gives the threads back
        updated = copy.deepcopy({"policy": m.policy.state_dict(), "value": m.value.state_dict()})
        results[threads] = (result, updated, set(value_threads))
    (one, one_weights, one_threads), (two, two_weights, two_threads) = results[1], results[2]
    assert one_threads == {threading.current_thread().name}  # one thread: the value side in line
    assert len(two_threads) == 1 and two_threads.pop().startswith("rlhf-value")  # two: on the value worker
    for a, b in zip(one.minibatch_stats, two.minibatch_stats, strict=True):
        assert a == b
    moved = 0
    for name in ("policy", "value"):
        for key, value in two_weights[name].items():
            assert torch.equal(value, one_weights[name][key]), key
            moved += not torch.equal(value, weights[name][key])
    assert moved > 0  # the update changed the weights


def test_rollout_kl_is_zero_before_training_and_rewards_sum(stack):
    cfg = _cfg()
    _, _, r = _rollout(stack, cfg)
    assert torch.allclose(r.scored.logprobs, r.scored.ref_logprobs, atol=1e-6)  # policy == reference at the start
    # per-token rewards: KL part ~0, so their sum is the shaped score
    assert torch.allclose(r.non_score_rewards.sum(1), torch.zeros(len(r.indices)), atol=1e-5)


def test_ppo_resume_matches_an_uninterrupted_run(stack, tmp_path):
    cfg = _cfg(total_episodes=64, save_every=2)
    full, resumed = {}, {}
    _train(
        stack,
        cfg,
        tmp_path / "full",
        lambda m, s: full.__setitem__(s, m),
    )
    with pytest.raises(TrainingInterrupted):
        _train(
            stack,
            cfg,
            tmp_path / "resumed",
            lambda m, s: resumed.__setitem__(s, m),
            stop_after=3,
        )
    assert sorted(resumed) == [1, 2, 3]
    resumed_steps = []
    result = _train(
        stack,
        cfg,
        tmp_path / "resumed",
        lambda m, s: (resumed_steps.append(s), resumed.__setitem__(s, m)),
    )
    assert resumed_steps == [4]  # continues after the saved step; no step logged twice
    assert result.updates == 4
    for step in full:
        for key, value in full[step].items():
            if not key.startswith(NOT_DETERMINISTIC):
                assert resumed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_reward_model_resume_matches(stack, tmp_path):
    # the uninterrupted run is the stack's own reward model: the same config, SFT model, data and seed
    cfg, data = stack["rm_cfg"], stack["data"]
    full, resumed = stack["rm_logged"], {}
    assert full, "the stack's reward model logged its steps"
    with pytest.raises(RMInterrupted):
        train_reward_model(
            cfg,
            RUNTIME,
            stack["sft"],
            data.train,
            data.eval,
            tmp_path / "b",
            0,
            lambda m, s: resumed.__setitem__(s, m),
            stop_after=20,
        )
    b = train_reward_model(
        cfg, RUNTIME, stack["sft"], data.train, data.eval, tmp_path / "b", 0, lambda m, s: resumed.__setitem__(s, m)
    )
    assert sorted(resumed) == sorted(full)
    assert b.metrics["reward/best_eval_accuracy"] == pytest.approx(stack["rm_metrics"]["reward/best_eval_accuracy"])
    for step in full:
        for key, value in full[step].items():
            if key != "time/reward" and not key.startswith(NOT_DETERMINISTIC):
                assert resumed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_reward_model_learns_the_task(stack):
    assert stack["rm_metrics"]["reward/best_eval_accuracy"] > 0.75


def test_every_spec_statistic_is_logged(stack, tmp_path):
    logged = {}
    _train(
        stack,
        _cfg(total_episodes=16, record_rollouts=True),
        tmp_path,
        lambda m, s: logged.update(m),
        gold_fn=synthetic.gold_score,
    )
    expected = {
        "objective/kl",
        "objective/kl_coef",
        "objective/logprobs",
        "objective/ref_logprobs",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/scores",
        "objective/scores_std",
        "objective/scores_min",
        "objective/scores_max",
        "objective/rlhf_reward",
        "objective/stop_rate",
        "objective/gold_score",
        "policy/loss",
        "value/loss",
        "loss/total",
        "policy/entropy",
        "policy/approxkl",
        "policy/policykl",
        "policy/clipfrac",
        "policy/ratio_mean",
        "policy/ratio_var",
        "value/clipfrac",
        "advantages/mean",
        "returns/mean",
        "returns/var",
        "value/mean",
        "value/var",
        "value/error",
        "value/explained_variance",
        "policy/grad_norm",
        "value/grad_norm",
        "policy/lr",
        "value/lr",
        "tokens/query_len_mean",
        "tokens/query_len_std",
        "tokens/response_len_mean",
        "tokens/response_len_std",
        "time/generate",
        "time/score",
        "time/advantages",
        "time/optimize",
        "time/stats",
        "time/total",
        "speed/episodes_per_s",
        "speed/tokens_per_s",
        "memory/peak_mb",
        *(
            f"dist/{q}_{p}"
            for q in ("kl", "scores", "response_len", "advantages", "ratio")
            for p in ("p05", "p50", "p95")
        ),
    }
    assert expected <= set(logged), expected - set(logged)
    assert all(math.isfinite(v) for v in logged.values())
    records = pd.read_parquet(tmp_path / "rollouts" / "update_00001.parquet")
    assert len(records) == 16 and {"prompt", "response", "score", "kl", "gold_score"} <= set(records.columns)


@pytest.mark.parametrize(
    "options",
    [
        {"value_model": "policy_head"},
        {"kl_controller": "adaptive", "kl_estimator": "k3", "whiten_rewards": True, "top_k": 20, "top_p": 0.9},
        {"whiten_rewards": True, "whiten_rewards_keep_mean": False, "whiten_advantages": False},
        {"gradient_accumulation_steps": 2, "gradient_checkpointing": True, "entropy_coef": 0.01, "target_kl": 0.001},
        {"lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["c_attn"]}},
        {
            "missing_eos_mode": "replace",
            "missing_eos_penalty": -2.0,
            "min_response_length": 4,
            "min_length_penalty": 1.0,
            "min_length_mode": "replace",
            "score_clip": 1.5,
            "lr_schedule": "constant",
            "stop_tokens": ["."],
        },
    ],
)
def test_options_train_and_save_loadable_checkpoints(stack, tmp_path, options):
    logged = {}
    result = _train(
        stack,
        _cfg(total_episodes=32, **options),
        tmp_path,
        lambda m, s: logged.__setitem__(s, m),
    )
    assert result.updates == 2 and all(math.isfinite(logged[s]["policy/loss"]) for s in (1, 2))
    policy = load_causal_lm(result.policy_path, torch.device("cpu"))  # merged LoRA loads as a plain model
    assert policy.config.model_type == "gpt2"
    if options.get("lora"):
        # LoRA's B starts at zero: the policy equals its adapters-disabled base, the reference, at update 1 ...
        assert logged[1]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
        # ... and training moved the adapters only, so the merged policy differs from the SFT model
        sft = load_causal_lm(stack["sft"], torch.device("cpu"))
        assert not torch.equal(policy.transformer.h[0].attn.c_attn.weight, sft.transformer.h[0].attn.c_attn.weight)
        assert torch.equal(policy.transformer.h[0].mlp.c_fc.weight, sft.transformer.h[0].mlp.c_fc.weight)


@pytest.mark.parametrize("value_model", ["separate", "policy_head"])
def test_critic_warmup_trains_the_value_model_alone_first(stack, tmp_path, value_model, recwarn):
    logged = {}
    cfg = _cfg(total_episodes=64, critic_warmup=2, value_model=value_model)
    result = _train(stack, cfg, tmp_path, lambda m, s: logged.__setitem__(s, m))
    assert result.updates == 4 and [logged[s]["policy/held"] for s in (1, 2, 3, 4)] == [1.0, 1.0, 0.0, 0.0]
    # the policy's linear schedule runs over the 2 updates that train it, the value model's over all 4
    assert [logged[s]["policy/lr"] for s in (1, 2, 3, 4)] == pytest.approx([cfg.lr, cfg.lr, cfg.lr / 2, 0.0])
    assert logged[1]["value/lr"] == pytest.approx(cfg.value_lr * 3 / 4)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    # updates 1 and 2 left the policy as it was: update 3's rollouts still come from the SFT policy ...
    assert all(logged[s]["objective/kl"] == pytest.approx(0.0, abs=1e-6) for s in (1, 2, 3))
    # ... while the value model learned from them (its loss fell), and update 3 trained the policy
    assert logged[3]["value/loss"] < logged[1]["value/loss"]
    sft = load_causal_lm(stack["sft"], torch.device("cpu"))
    policy = load_causal_lm(result.policy_path, torch.device("cpu"))
    assert not torch.equal(policy.transformer.h[0].attn.c_attn.weight, sft.transformer.h[0].attn.c_attn.weight)


def test_reward_model_with_a_different_tokenizer_retokenizes(stack, tmp_path):
    # a reward model whose tokenizer has a different vocabulary: scores go through decoded text
    texts = [d.prompt + d.response for d in synthetic.demonstrations(300, seed=5)]
    tok = build_tokenizer(texts, vocab_size=290)
    lm = build_tiny_gpt2(tok, n_layer=1, n_head=2, n_embd=32, n_positions=128, seed=1)
    lm.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    cfg = _cfg(total_episodes=16)
    m = load_models(cfg, RUNTIME, stack["sft"], str(tmp_path / "other"), stack["rm"], torch.device("cpu"))
    assert not m.same_tokenizer
    logged = {}
    train_ppo(
        PolicyRun(
            cfg,
            RUNTIME,
            stack["sft"],
            str(tmp_path / "other"),
            stack["prompts"],
            tmp_path / "run",
            0,
            lambda mm, s: logged.update(mm),
            value_path=stack["rm"],
        )
    )
    assert math.isfinite(logged["objective/scores"])


def test_negated_advantages_make_the_gold_reward_fall(stack, tmp_path, monkeypatch):
    """The pipeline's own quality metric tells a working PPO from a broken one."""
    cfg = _cfg(total_episodes=192, batch_size=32, num_mini_batches=2, num_ppo_epochs=4, lr=3e-4, max_new_tokens=20)

    def gold_curve(folder):
        gold = {}
        _train(
            stack,
            cfg,
            folder,
            lambda m, s: gold.__setitem__(s, m["objective/gold_score"]),
            gold_fn=synthetic.gold_score,
        )
        return gold

    working = gold_curve(tmp_path / "working")
    real_gae = ppo_update.gae
    monkeypatch.setattr(
        ppo_update, "gae", lambda *a, **k: GAEOutput(-real_gae(*a, **k).advantages, real_gae(*a, **k).returns)
    )
    broken = gold_curve(tmp_path / "broken")
    assert working[6] > working[1] + 0.1, (working, broken)
    assert broken[6] < working[6] - 0.3, (working, broken)


def test_train_policy_is_one_entry_point_for_one_process_and_several(tmp_path, monkeypatch):
    """rlhf.ppo.launch.train_policy: one process trains in place (train_ppo, with the prepared folder's prompts,
    gold scorer and held-out prompts); several run under torchrun (run_data_parallel, with the folder's files)."""
    from rlhf.ppo import launch
    from rlhf.ppo.trainer import PPOResult

    data = tmp_path / "data"
    data.mkdir()
    pd.DataFrame({"prompt": ["p1", "p2"]}).to_parquet(data / "prompts.parquet")
    pd.DataFrame({"prompt": ["e1", "e1", "e2", "e3"]}).to_parquet(data / "eval.parquet")
    (data / "manifest.json").write_text(f'{{"gold_reward": "{synthetic.GOLD_REWARD_NAME}"}}')
    calls: dict[str, tuple] = {}

    def fake(name):
        def run(*args, **kwargs):
            calls[name] = (args, kwargs)
            return PPOResult("policy", "value", "digest", 1)

        return run

    monkeypatch.setattr(launch, "train_ppo", fake("one"))
    monkeypatch.setattr(launch, "run_data_parallel", fake("several"))
    cfg = _cfg(eval_every=1, eval_n_prompts=2)
    log, on_eval = (lambda m, s: None), (lambda s, m: None)
    inputs = PolicyInputs.prepared(cfg, RUNTIME, 0, data, policy_path="sft", reward_path="rm", out_dir=str(tmp_path))
    assert launch.train_policy(inputs, log=log, on_eval=on_eval).policy_path == "policy"
    (run,), kw = calls.pop("one")
    assert (run.policy_path, run.reward_path, run.prompts, run.out_dir, run.seed) == (
        "sft",
        "rm",
        ["p1", "p2"],
        tmp_path,
        0,
    )
    assert run.value_path == "rm" and run.gold_fn is synthetic.gold_score and run.on_eval is on_eval and run.log is log
    assert run.eval_prompts == ["e1", "e2"]  # the first ppo.eval_n_prompts distinct held-out prompts
    launch.train_policy(inputs, processes=2, tracking_uri="sqlite:///m.db", run_id="r", echo=print)
    (got, processes), kw = calls.pop("several")
    assert got is inputs and processes == 2 and not calls
    assert (kw["tracking_uri"], kw["run_id"], kw["echo"]) == ("sqlite:///m.db", "r", print)


def test_policy_inputs_travel_to_the_processes_as_they_are(tmp_path):
    """run_data_parallel writes the inputs to one file that every process reads (`--inputs`): the same sections,
    paths and settings come back, the progress bars off."""
    from rlhf.ppo.launch import inputs_from_args, parse_args

    cfg = _cfg(eval_every=2, advantage_estimator="grpo", samples_per_prompt=2)
    inputs = PolicyInputs.prepared(
        cfg, RUNTIME.model_copy(update={"progress": True}), 7, tmp_path / "data", policy_path="sft",
        reward_path=None, out_dir=str(tmp_path / "out"), reward=RewardConfig(source="function", function="m:f"),
        stop_after=3,
    )  # fmt: skip
    inputs.write(tmp_path / "inputs.yaml")
    back, tracking = inputs_from_args(parse_args(["--inputs", str(tmp_path / "inputs.yaml")]))
    assert tracking == TrackingConfig() and back.ppo == inputs.ppo and back.reward == inputs.reward
    assert back.runtime == inputs.runtime.model_copy(update={"progress": False})
    assert (back.seed, back.reward_path, back.stop_after, back.eval_file) == (
        7,
        None,
        3,
        str(tmp_path / "data" / "eval.parquet"),
    )
    with pytest.raises(SystemExit):
        parse_args(["--policy", "sft"])  # neither --inputs nor the paths


def test_best_checkpoint_keeps_the_first_best_and_resumes_from_its_files(tmp_path):
    """The reward trainer's best checkpoint: the earliest of equal held-out accuracies, saved with the resume state
    and read back from it."""
    from safetensors.torch import save_file

    from rlhf.train.reward import BEST_FILE, BestCheckpoint

    model = torch.nn.Linear(2, 1)
    best = BestCheckpoint(tmp_path, torch.device("cpu"))
    assert best.tensor_files() is None
    best.update(model, 0.5, 2)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    best.update(model, 0.5, 4)  # not better: the step-2 weights stay
    best.update(model, 0.25, 6)
    assert (best.accuracy, best.step) == (0.5, 2) and best.fields() == {"best_acc": 0.5, "best_step": 2}
    save_file(best.tensor_files()[BEST_FILE], tmp_path / BEST_FILE)
    resumed = BestCheckpoint(tmp_path, torch.device("cpu"))
    resumed.resume(best.fields())
    resumed.load_into(model)
    assert resumed.step == 2 and all(torch.equal(model.state_dict()[k], v) for k, v in first.items())


CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def test_a_batch_holds_whole_groups_of_one_prompt():
    ids = [[i + 10] for i in range(7)]
    batch = prompt_batch(ids, 0, 8, 0, 0, samples_per_prompt=4)  # 8 episodes: 2 prompts, 4 samples each
    assert batch.indices[:4] == [batch.indices[0]] * 4 and batch.indices[4:] == [batch.indices[4]] * 4
    assert batch.indices[0] != batch.indices[4]
    # the prompt stream is the same as with one sample a prompt: the G-sample batch takes its first prompts
    assert batch.indices[::4] == prompt_batch(ids, 0, 2, 0, 0).indices
    # two processes: each takes one whole group
    rank1 = prompt_batch(ids, 0, 8, 0, 0, rank=1, world_size=2, samples_per_prompt=4)
    assert rank1.indices == batch.indices[4:]


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_critic_free_estimators_load_train_and_save_no_value_model(stack, tmp_path, estimator):
    cfg = _cfg(advantage_estimator=estimator, samples_per_prompt=4)
    m, state, r = _rollout(stack, cfg)
    assert m.value is None and state.value_opt is None and state.value_params == []
    assert r.scored.values is None and r.returns is None
    # the advantages of a group: the group's scores against their baseline, every token of a response the same
    scores = r.shaped_scores.view(-1, 4)
    if estimator in ("grpo", "dr_grpo", "rloo"):
        first_token = r.advantages[:, 0].view(-1, 4)
        centred = scores - scores.mean(1, keepdim=True)
        expected = {
            "grpo": centred / (scores.std(1, keepdim=True) + 1e-6),
            "dr_grpo": centred,
            "rloo": centred * 4 / 3,  # s - mean(others) = G / (G - 1) * (s - mean)
        }[estimator]
        torch.testing.assert_close(first_token, expected, atol=1e-4, rtol=1e-4)
    else:  # whitened returns: mean 0 over the real tokens
        assert abs(float((r.advantages * r.mask).sum() / r.mask.sum())) < 1e-4
    assert r.group_stats["group/zero_std_fraction"] >= 0.0
    logged: dict[int, dict[str, float]] = {}
    result = _train(stack, cfg, tmp_path / estimator, lambda metrics, step: logged.__setitem__(step, metrics))
    last = logged[max(logged)]
    assert not [k for k in last if k.startswith(("value/", "returns/"))]  # absent, not zeros
    assert {"group/reward_std", "group/zero_std_fraction", "group/distinct_responses", "policy/loss"} <= set(last)
    assert 0 < last["group/distinct_responses"] <= 1
    assert ("policy/kl_loss" in last) == (estimator in ("grpo", "dr_grpo"))  # the papers' KL placement
    assert all(math.isfinite(v) for v in last.values())
    assert result.value_path == "" and not (tmp_path / estimator / "final" / "value").exists()
    assert (tmp_path / estimator / "final" / "policy" / "config.json").is_file()


# DAPO, GSPO and RLOO with the whole response's ratio: (config, what only it logs)
NEW_OBJECTIVES = {
    "dapo": (dict(advantage_estimator="dapo"), "dynamic_sampling/extra_rounds"),
    "gspo": (dict(advantage_estimator="grpo", importance_sampling_level="sequence"), "policy/seq_clipfrac"),
    "rloo_sequence": (
        dict(advantage_estimator="rloo", importance_sampling_level="sequence_sum"),
        "policy/seq_clipfrac",
    ),
}


@pytest.mark.parametrize("name", NEW_OBJECTIVES)
def test_dapo_gspo_and_sequence_rloo_train(stack, tmp_path, name):
    overrides, own_metric = NEW_OBJECTIVES[name]
    cfg = _cfg(samples_per_prompt=4, **overrides)
    logged: dict[int, dict[str, float]] = {}
    _train(stack, cfg, tmp_path / name, lambda metrics, step: logged.__setitem__(step, metrics))
    assert sorted(logged) == [1, 2, 3, 4]
    for metrics in logged.values():
        assert own_metric in metrics and all(math.isfinite(v) for v in metrics.values())
    first = logged[1]
    if name == "gspo":  # GSPO's ranges (3e-4, 4e-4): a sequence ratio that moves clips
        assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
        assert max(m["policy/seq_clipfrac"] for m in logged.values()) > 0
    if name == "dapo":
        assert (cfg.clip_low, cfg.clip_high, cfg.aggregation, cfg.overlong_tokens) == (0.2, 0.28, "token_mean", 2)
        assert first["dynamic_sampling/generated_episodes"] >= cfg.batch_size


def test_dynamic_sampling_replaces_groups_without_spread(stack, tmp_path):
    # a coarse rule as the reward (1 for a full stop at the end, else 0): many groups score all the same
    reward_cfg = RewardConfig(source="function", function="tests.planted_rewards:ends_a_sentence")
    runs = {}
    for rounds in (0, 3):
        cfg = _cfg(advantage_estimator="dapo", samples_per_prompt=4, dynamic_sampling_rounds=rounds, overlong_buffer=0)
        logged: dict[int, dict[str, float]] = {}
        log = lambda metrics, step, logged=logged: logged.__setitem__(step, metrics)  # noqa: E731
        _train(stack, cfg, tmp_path / str(rounds), log, reward=None, reward_cfg=reward_cfg)
        runs[rounds] = logged
    plain, dynamic = runs[0], runs[3]
    assert not any(k.startswith("dynamic_sampling/") for k in plain[1])
    dropped = sum(m["dynamic_sampling/dropped_groups"] for m in dynamic.values())
    assert dropped > 0, "the test needs groups without spread"
    # the batch trained on has fewer groups without spread than the plain one's (filled ones only)
    for step, metrics in dynamic.items():
        filled = metrics["dynamic_sampling/filled_groups"]
        assert metrics["group/zero_std_fraction"] == pytest.approx(filled / (cfg.batch_size // 4))
        assert metrics["dynamic_sampling/extra_rounds"] <= 3
        generated = metrics["dynamic_sampling/generated_episodes"]
        assert generated == cfg.batch_size * (1 + metrics["dynamic_sampling/extra_rounds"]), step
    assert sum(m["group/zero_std_fraction"] for m in dynamic.values()) < sum(
        m["group/zero_std_fraction"] for m in plain.values()
    )


def test_a_run_with_dynamic_sampling_resumes_as_if_never_stopped(stack, tmp_path):
    reward_cfg = RewardConfig(source="function", function="tests.planted_rewards:ends_a_sentence")
    cfg = _cfg(advantage_estimator="dapo", samples_per_prompt=4, save_every=2, overlong_buffer=0)
    full, resumed = {}, {}

    def run(folder, logged, **kw):
        _train(stack, cfg, folder, lambda m, s: logged.__setitem__(s, m), reward=None, reward_cfg=reward_cfg, **kw)

    run(tmp_path / "full", full)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path / "resumed", resumed, stop_after=2)
    run(tmp_path / "resumed", resumed)
    assert sorted(resumed) == sorted(full) == [1, 2, 3, 4]
    for step in full:
        for key, value in full[step].items():
            if not key.startswith(NOT_DETERMINISTIC):
                assert resumed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_a_critic_free_run_resumes_as_if_never_stopped(stack, tmp_path):
    cfg = _cfg(advantage_estimator="grpo", samples_per_prompt=4, save_every=2)
    full, resumed = {}, {}
    _train(stack, cfg, tmp_path / "full", lambda m, s: full.__setitem__(s, m))
    with pytest.raises(TrainingInterrupted):
        _train(stack, cfg, tmp_path / "resumed", lambda m, s: resumed.__setitem__(s, m), stop_after=2)
    assert not (tmp_path / "resumed" / "state" / "value.safetensors").exists()
    _train(stack, cfg, tmp_path / "resumed", lambda m, s: resumed.__setitem__(s, m))
    assert sorted(resumed) == sorted(full) == [1, 2, 3, 4]
    for step in full:
        for key, value in full[step].items():
            if not key.startswith(NOT_DETERMINISTIC):
                assert resumed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_reward_function_scores_without_a_reward_model(stack, tmp_path, estimator):
    reward_cfg = RewardConfig(source="function", function="rlhf.data.synthetic:gold_reward")
    cfg = _cfg(advantage_estimator=estimator, samples_per_prompt=4 if estimator == "grpo" else 1)
    m = load_models(cfg, RUNTIME, stack["sft"], None, None, torch.device("cpu"), reward_cfg)
    assert m.reward is None and (m.value is None) == (estimator == "grpo")  # gae: a value model from the SFT model
    logged: dict[int, dict[str, float]] = {}
    train_ppo(
        PolicyRun(
            cfg,
            RUNTIME,
            stack["sft"],
            None,
            stack["prompts"],
            tmp_path,
            0,
            lambda metrics, step: logged.__setitem__(step, metrics),
            gold_fn=synthetic.gold_score,
            reward_cfg=reward_cfg,
        )
    )
    for metrics in logged.values():  # the score is the gold reward itself
        assert metrics["objective/scores"] == pytest.approx(metrics["objective/gold_score"], abs=1e-5)


def test_a_reward_function_on_top_of_the_reward_model_adds_its_weighted_score(stack):
    cfg = _cfg()
    _, _, plain = _rollout(stack, cfg)
    reward_cfg = RewardConfig(function="rlhf.data.synthetic:gold_reward", function_weight=0.5)
    m = load_models(cfg, RUNTIME, stack["sft"], stack["rm"], stack["rm"], torch.device("cpu"), reward_cfg)
    state = load_state(stack["root"] / "no-state", m, cfg, 0, torch.device("cpu"))
    ids = encode_prompts(m.tokenizer, stack["prompts"], cfg.max_prompt_tokens)
    batch = prompt_batch(ids, 0, cfg.batch_size, 0, m.tokenizer.pad_token_id)
    settings, plan = generation_settings(cfg, m), ExecutionPlan.for_models(m)
    r = ppo_update.generate_and_score(m, batch, stack["prompts"], cfg, settings, state.sample_generator, plan)
    texts = m.tokenizer.batch_decode(
        r.scored.resp.tokens.masked_fill(r.scored.resp.mask == 0, m.tokenizer.pad_token_id), skip_special_tokens=True
    )
    gold = torch.tensor(synthetic.gold_reward([stack["prompts"][i] for i in batch.indices], texts))
    # the same seed samples the same responses: the model's score plus half the gold score
    torch.testing.assert_close(r.scored.scores, plain.scored.scores + 0.5 * gold, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "estimator, aggregation",
    [("grpo", "seq_mean_token_mean"), ("dr_grpo", "seq_mean_token_sum_norm"), ("rloo", "token_mean")],
)
def test_a_critic_free_update_in_two_halves_is_the_update_of_one_thread(stack, monkeypatch, estimator, aggregation):
    """Without a value model, two torch threads split each micro-batch into two halves run side by side
    (threads.split_policy_work), their losses weighted by their share of the aggregation: the same gradients, so the
    same statistics and weights as the one-thread update up to float rounding (not bit for bit: the sums run in
    another order), for each aggregation; the entropy bonus and the KL in the loss (grpo, dr_grpo) included."""
    cfg = _cfg(advantage_estimator=estimator, samples_per_prompt=4, entropy_coef=0.01)
    assert cfg.aggregation == aggregation
    m, state, r = _rollout(stack, cfg)
    assert m.value is None
    weights = copy.deepcopy(m.policy.state_dict())
    optim_state = copy.deepcopy(state.policy_opt.state_dict())
    shuffle = state.shuffle_generator.get_state()
    threads_seen: list[str] = []
    real = ppo_optimise._policy_micro

    def spy(*args, **kwargs):
        threads_seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(ppo_optimise, "_policy_micro", spy)
    results = {}
    for threads in (1, 2):
        m.policy.load_state_dict(weights)
        state.policy_opt.load_state_dict(optim_state)
        state.shuffle_generator.set_state(shuffle)
        threads_seen.clear()
        torch.set_num_threads(threads)
        # the halves wherever the test runs: the plan chooses them on AVX-512 CPUs only (below)
        plan = replace(ExecutionPlan.for_models(m), split_policy=threads == 2)
        result = ppo_optimise.optimize(m, state, r, cfg, plan)
        results[threads] = (result, copy.deepcopy(m.policy.state_dict()), list(threads_seen))
    (one, one_weights, one_threads), (two, two_weights, two_threads) = results[1], results[2]
    assert set(one_threads) == {threading.current_thread().name}
    assert len(two_threads) == 2 * len(one_threads)  # two halves a micro-batch, one of them on the second thread
    assert any(name.startswith("rlhf-value") for name in two_threads)
    for a, b in zip(one.minibatch_stats, two.minibatch_stats, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    moved = 0
    for key, value in two_weights.items():
        torch.testing.assert_close(value, one_weights[key], atol=1e-5, rtol=1e-4)
        moved += not torch.equal(value, weights[key])
    assert moved > 0
    # the halves are float32's on AVX-512: under bf16 autocast and held to AVX2 one micro-batch on both threads
    # measured faster (threads.py)
    torch.set_num_threads(2)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert ExecutionPlan.for_models(m, torch.float32).split_policy == avx512
    assert not ExecutionPlan.for_models(m, torch.bfloat16).split_policy
    assert ExecutionPlan.for_models(m, torch.bfloat16).optimise_threads is None  # every op on both threads


def test_a_stop_request_ends_training_in_a_worker_thread_at_the_next_update(stack, tmp_path):
    # a sweep's variants train in worker threads, which Ctrl-C does not interrupt: the command's signal handler
    # requests a stop, and the trainer raises at its next update (rlhf.stop_request)
    from rlhf.errors import StopRequested
    from rlhf.stop_request import clear_stop_request, raise_if_stop_requested, request_stop

    logged: list[int] = []
    outcome: list[BaseException] = []

    def log(metrics, step):
        logged.append(step)
        if step == 2:
            request_stop()

    def train():
        try:
            _train(stack, _cfg(total_episodes=16 * 6), tmp_path, log)
        except BaseException as err:  # noqa: BLE001 (the test reads it)
            outcome.append(err)

    try:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join(120)
        raise_if_stop_requested("the main thread")  # nothing: the signal itself interrupts the main thread
    finally:
        clear_stop_request()
    assert not worker.is_alive()
    assert logged == [1, 2] and len(outcome) == 1 and isinstance(outcome[0], StopRequested), outcome
    assert "PPO training at update 3" in str(outcome[0])
