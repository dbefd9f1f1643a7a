"""Reward-model ensembles and the over-optimisation alarm: the objectives and the held-out statistics by
hand-computed numbers, the diversity signs, the alarm's rule on planted histories, and what ppo.on_overoptimisation
keeps, on a tiny real stack."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig, load_config
from rlhf.data import synthetic
from rlhf.errors import ConfigError
from rlhf.eval import overoptimisation
from rlhf.eval.overoptimisation import OveroptimisationAlarm, response_stats
from rlhf.models.loading import load_tokenizer
from rlhf.models.reward_ensemble import EnsembleSpec, RewardEnsemble, load_reward, member_paths
from rlhf.ops import ensemble_scores
from rlhf.ppo.periodic_eval import EvalGuard
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.trainer import train_ppo
from rlhf.train.reward_ensemble import ensemble_pair_stats

# two members, three responses
MEMBERS = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, -2.0]])


def test_mean_uwo_and_wco_by_hand():
    # mean: (1+3)/2 = 2, (0+0)/2 = 0, (2-2)/2 = 0
    assert ensemble_scores(MEMBERS, "mean").tolist() == [2.0, 0.0, 0.0]
    # population variance: ((1-2)^2 + (3-2)^2)/2 = 1; 0; ((2-0)^2 + (-2-0)^2)/2 = 4; uwo = mean - 0.5 * var
    assert ensemble_scores(MEMBERS, "uwo", 0.5).tolist() == [1.5, 0.0, -2.0]
    # wco: the smaller member score
    assert ensemble_scores(MEMBERS, "wco").tolist() == [1.0, 0.0, -2.0]
    one = MEMBERS[:1]  # one member: every objective is its score
    for objective in ("mean", "uwo", "wco"):
        assert ensemble_scores(one, objective, 3.0).tolist() == [1.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="unknown ensemble objective 'median'"):
        ensemble_scores(MEMBERS, "median")


def test_held_out_statistics_by_hand():
    chosen = torch.tensor([[2.0, 1.0], [4.0, 2.0]])  # (K=2, n=2 pairs)
    rejected = torch.tensor([[0.0, 2.0], [2.0, 0.0]])
    stats, offsets, in_dist = ensemble_pair_stats(chosen, rejected, RewardConfig(ensemble_objective="wco"))
    # member means over its 4 scores: 1.25 and 2.0; less their average 1.625: -0.375 and +0.375
    assert offsets.tolist() == pytest.approx([-0.375, 0.375])
    # member 0 prefers chosen on pair 0 only; member 1 on both
    assert stats["reward_ensemble/member_0_accuracy"] == 0.5
    assert stats["reward_ensemble/member_1_accuracy"] == 1.0
    # centred chosen: [[2.375, 1.375], [3.625, 1.625]]; std over members of each pair: 0.625, 0.125 -> mean 0.375
    assert in_dist == pytest.approx(0.375)
    # centred rejected: [[0.375, 2.375], [1.625, -0.375]]; wco chosen [2.375, 1.375] vs rejected [0.375, -0.375]
    assert stats["reward_ensemble/accuracy_wco"] == 1.0
    assert stats["reward_ensemble/accuracy"] == 1.0
    assert stats["reward_ensemble/agreement"] == 0.5  # pair 1: the members disagree


def test_response_stats_by_hand():
    stats = response_stats(["a b c", "a b c", "x y x y"])
    # bigrams: (a b)(b c) twice, (x y)(y x)(x y): 7 in all, 4 distinct
    assert stats["distinct_2"] == pytest.approx(4 / 7)
    assert stats["identical_share"] == pytest.approx(2 / 3)
    # the third response repeats one of its 3 bigrams
    assert stats["repetition"] == pytest.approx((0 + 0 + 1 / 3) / 3)


def test_near_identical_responses_by_hand():
    # one answer to every prompt, give or take the last word: the sag and the collapse both look like this
    one_answer = [
        "the plot was excellent and the acting was great .",
        "the plot was excellent and the acting was great !",
        "the plot was excellent and the acting was great . .",
    ]
    assert response_stats(one_answer)["near_identical_share"] == 1.0
    assert response_stats(one_answer)["identical_share"] == 0.0  # none is word for word another's
    # a healthy policy's reviews share their frame ("the ... was ...") but not their words
    healthy = [
        "the plot was excellent and the acting was great .",
        "the camera was dull and the music was boring .",
        "the dialogue was wonderful .",
    ]
    assert response_stats(healthy)["near_identical_share"] == 0.0
    # 2 of 4 alike: a share, not a flag; bigram sets {a b, b c, c d} and {a b, b c, c e}: Jaccard 2/4, not near
    mixed = ["w x y z", "w x y z q", "a b c d", "a b c e"]  # the first two: Jaccard 3/4 ... under 0.8
    assert response_stats(mixed)["near_identical_share"] == 0.0
    mixed[1] = "w x y z z"  # bigrams {w x, x y, y z, z z} against {w x, x y, y z}: 3/4 still under
    assert response_stats(mixed)["near_identical_share"] == 0.0
    mixed[1] = "w x y z w x"  # {w x, x y, y z, z w}: 3/4
    assert response_stats(mixed)["near_identical_share"] == 0.0
    mixed[0], mixed[1] = "v w x y z", "v w x y z z"  # {v w, w x, x y, y z} against the same plus {z z}: 4/5
    assert response_stats(mixed)["near_identical_share"] == 0.5
    assert response_stats(["", "", "a b"])["near_identical_share"] == pytest.approx(2 / 3)  # two empty answers


def test_group_distinct_share_by_hand():
    from rlhf.ppo.stats import group_distinct_share

    # two groups of 3 samples; padding (mask 0) never tells two responses apart
    tokens = torch.tensor([[5, 6, 9], [5, 6, 7], [5, 7, 0], [1, 2, 3], [1, 2, 3], [1, 2, 8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    # group 0: (5 6), (5 6), (5 7): 2 distinct of 3; group 1: (1 2 3) twice, (1 2 8): 2 of 3
    assert group_distinct_share(tokens, mask, 3) == pytest.approx(4 / 6)
    assert group_distinct_share(tokens, torch.ones_like(mask), 3) == pytest.approx(5 / 6)  # 9 vs 7 count now
    assert group_distinct_share(tokens, mask, 1) == 1.0  # one sample a prompt: every group is distinct


def _signs(distinct=0.6, repetition=0.0, ratio=None, mean=None, minimum=None) -> dict[str, float]:
    stats = {"distinct_2": distinct, "identical_share": 0.0, "repetition": repetition, "score": 0.0}
    if ratio is not None:
        stats |= {"disagreement_ratio": ratio, "ensemble_mean": mean, "ensemble_min": minimum, "ensemble_std": 0.1}
    return stats


def test_the_alarm_fires_on_a_planted_collapse_and_stays_quiet_on_a_healthy_run():
    healthy = [_signs(0.6), _signs(0.5), _signs(0.45), _signs(0.4)]
    alarm = OveroptimisationAlarm()
    assert [alarm.check(step, s) for step, s in enumerate(healthy)] == [None] * 4
    collapsing = [_signs(0.6), _signs(0.5), _signs(0.2), _signs(0.1), _signs(0.1)]
    alarm = OveroptimisationAlarm()
    fired = [alarm.check(10 * step, s) for step, s in enumerate(collapsing)]
    # the rule holds from 20 and fires where it held twice in a row, once
    assert fired[:3] == [None, None, None] and fired[3].step == 30 and fired[4] is None
    assert "distinct bigrams 0.10, SFT 0.60" in fired[3].reasons[0] and alarm.fired.step == 30
    assert alarm.quiet == [True, True, False, False, False]  # 20's policy is never kept
    taken_back = OveroptimisationAlarm()
    checks = [_signs(0.6), _signs(0.2), _signs(0.5), _signs(0.2)]
    assert [taken_back.check(10 * step, s) for step, s in enumerate(checks)] == [None] * 4
    assert taken_back.check(40, _signs(0.1), last=True).step == 40  # the last evaluation: nothing takes it back
    repeating = OveroptimisationAlarm()
    repeating.check(0, _signs(repetition=0.05))
    # repeated bigrams are logged, not a condition: longer healthy reviews repeat `the ... was` (docs)
    assert repeating.check(5, _signs(repetition=0.25)) is None


def test_the_ensemble_conditions():
    alarm = OveroptimisationAlarm(in_distribution_std=0.2, confirm=1)  # each condition where it first holds
    assert alarm.check(0, _signs(ratio=1.2, mean=0.0, minimum=-0.2)) is None
    assert alarm.check(10, _signs(ratio=1.5, mean=0.5, minimum=0.3)) is None
    # the mean rose (0.5 -> 0.9) while the min fell 0.3 -> 0.1: 1 in-distribution std, over CONSERVATIVE_FALL
    fired = alarm.check(20, _signs(ratio=1.5, mean=0.9, minimum=0.1))
    assert fired.reasons == ["the ensemble's worst score fell 1.0 held-out stds while its mean rose"]
    disagreeing = OveroptimisationAlarm(in_distribution_std=0.2, confirm=1)
    disagreeing.check(0, _signs(ratio=1.0, mean=0.0, minimum=-0.2))
    limit = overoptimisation.DISAGREEMENT_RATIO
    assert disagreeing.check(10, _signs(ratio=limit - 0.1, mean=0.2, minimum=0.0)) is None
    assert "disagree" in disagreeing.check(20, _signs(ratio=limit + 0.5, mean=0.3, minimum=0.1)).reasons[0]


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))


def test_stop_and_keep_best_keep_the_right_parameters():
    scores = {0: 0.0, 10: 0.8, 20: 0.5, 30: 0.9}  # the alarm fires at step 30 (distinct bigrams collapse)
    for mode, kept_step in (("stop", 20), ("keep_best", 10), ("warn", None)):
        policy, guard = _Policy(), EvalGuard(mode, OveroptimisationAlarm())
        stopped = []
        for step, score in scores.items():
            policy.w.data.fill_(step)  # the policy "at" step
            metrics = {f"periodic_eval/{k}": v for k, v in _signs(0.1 if step == 30 else 0.6).items()}
            metrics["periodic_eval/score"] = score
            stopped.append(guard.observe(step, metrics, policy, last=step == 30))  # the run's last: fires alone
            assert metrics["periodic_eval/overoptimisation_alarm"] == float(step == 30)
        assert stopped == [False, False, False, mode == "stop"]
        kept = guard.kept()
        if kept_step is None:
            assert kept is None
        else:
            assert kept[0] == kept_step and kept[1]["w"].tolist() == [kept_step, kept_step]
        assert guard.result_metrics()["overoptimisation/alarm_step"] == 30.0
        said = guard.outcome(30)  # the end of the summary's WARNING: what was kept, and how to get the other
        if kept_step is None:
            assert "the final policy is the last update's (30; ppo.on_overoptimisation: warn)" in said
            assert "rerun with ppo.on_overoptimisation=stop" in said
        else:
            assert f"the final policy is update {kept_step}'s" in said and f"ppo.on_overoptimisation: {mode})" in said
            assert "rerun with ppo.on_overoptimisation=warn" in said
            assert said.startswith("training stopped there") == (mode == "stop")


def test_bad_ensemble_settings_are_one_sentence():
    cases = {
        "reward.ensemble_size=0": "reward.ensemble_size",
        "reward.ensemble_objective=median": "reward.ensemble_objective",
        "ppo.on_overoptimisation=keep_best": "ppo.on_overoptimisation 'keep_best' picks among the periodic evaluations",
    }
    for override, expected in cases.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(None, [override])
    # 'stop', the default, acts where there are periodic evaluations: without them the evaluation stage's check warns
    assert load_config(None, ["ppo.on_overoptimisation=stop"]).ppo.eval_every == 0
    assert PPOConfig().on_overoptimisation == "stop"
    with pytest.raises(ConfigError, match="reward.ensemble_size 3 needs reward models to train"):
        load_config(None, ["reward.source=function", "reward.function=rlhf.data.synthetic:gold_reward",
                           "reward.ensemble_size=3"])  # fmt: skip
    assert load_config(None, ["reward.ensemble_size=2"]).reward.member_config() == RewardConfig()


@pytest.fixture(scope="module")
def two_member_ensemble(tiny_checkpoints, tmp_path_factory):
    """The tiny reward model and a copy with another head, as an ensemble's folder."""
    root = tmp_path_factory.mktemp("ensemble")
    other = load_reward(tiny_checkpoints["reward"], torch.device("cpu"))
    torch.manual_seed(1)
    torch.nn.init.normal_(other.score.weight, std=0.5)
    other.save_pretrained(root / "member1")
    folder = root / "ensemble"
    folder.mkdir()
    EnsembleSpec([tiny_checkpoints["reward"], str(root / "member1")], [0.1, -0.1], 0.05, ["a", "b"]).write(folder)
    load_tokenizer(tiny_checkpoints["reward"]).save_pretrained(folder)
    return str(folder)


def test_an_ensemble_loads_as_its_members(tiny_checkpoints, two_member_ensemble):
    ensemble = load_reward(two_member_ensemble, torch.device("cpu"), "wco")
    assert isinstance(ensemble, RewardEnsemble) and len(ensemble.members) == 2
    assert member_paths(two_member_ensemble)[0] == tiny_checkpoints["reward"]
    assert member_paths(tiny_checkpoints["reward"]) == [tiny_checkpoints["reward"]]
    raw = torch.tensor([[1.0, 2.0], [0.0, 3.0]])
    assert torch.allclose(ensemble.centred(raw), torch.tensor([[0.9, 1.9], [0.1, 3.1]]))
    assert ensemble.combine(ensemble.centred(raw)).tolist() == pytest.approx([0.1, 1.9])


def test_ppo_with_an_ensemble_logs_the_members_view(tiny_checkpoints, two_member_ensemble, tmp_path):
    prompts = sorted({d.prompt for d in synthetic.demonstrations(200, seed=0)})
    held_out = sorted({d.prompt for d in synthetic.demonstrations(50, seed=1)})[:8]
    calls: list[tuple[int, dict[str, float]]] = []
    cfg = PPOConfig(total_episodes=32, batch_size=16, num_mini_batches=2, num_ppo_epochs=1, max_new_tokens=8,
                    record_rollouts=False, eval_every=1, advantage_estimator="rloo", samples_per_prompt=2)  # fmt: skip
    result = train_ppo(
        PolicyRun(
            cfg,
            RuntimeConfig(device="cpu", progress=False),
            tiny_checkpoints["policy"],
            two_member_ensemble,
            prompts,
            tmp_path / "run",
            0,
            lambda m, s: calls.append((s, dict(m))),
            eval_prompts=held_out,
            reward_cfg=RewardConfig(ensemble_size=2, ensemble_objective="uwo"),
        )
    )
    updates = [m for _, m in calls if "objective/scores" in m]
    assert len(updates) == 2
    for m in updates:
        assert m["ensemble/std"] > 0 and m["ensemble/min"] <= m["ensemble/mean"]
        assert m["ensemble/disagreement_ratio"] == pytest.approx(m["ensemble/std"] / 0.05)
        # uwo's score is at most the members' mean (variance subtracted)
        assert m["objective/scores"] <= m["ensemble/mean"] + 1e-6
    evals = [m for _, m in calls if "periodic_eval/disagreement_ratio" in m]
    assert len(evals) == 3 and all(math.isfinite(m["periodic_eval/distinct_2"]) for m in evals)
    assert result.metrics["overoptimisation/alarm_step"] in (-1.0, 1.0, 2.0)


def test_the_memory_estimate_counts_every_member():
    from transformers import AutoConfig

    from rlhf.memory import estimate, shape_of

    shape = shape_of(AutoConfig.for_model("gpt2", vocab_size=300, n_positions=128, n_layer=2, n_embd=64, n_head=2))
    one, four = (
        {e.stage: e.total for e in estimate(load_config(None, [f"reward.ensemble_size={k}"]), shape, "cuda")}
        for k in (1, 4)
    )
    assert four["ppo"] > one["ppo"] and four["evaluate"] > one["evaluate"]
    assert four["reward"] == one["reward"], "the members train one at a time"


def test_members_that_differ_are_configured_in_one_sentence():
    two = load_config(None, ["reward.ensemble_models=[org/a, org/b]"]).reward
    assert (two.ensemble_size, two.is_ensemble) == (2, True), "the list's length is the ensemble size"
    assert two.member_config() == RewardConfig(), "what a member trains from is its stage's parameter, not its config"
    assert load_config(None, ["reward.ensemble_models=[org/a, org/b]", "reward.ensemble_size=2"]).reward == two
    own = load_config(None, ["reward.ensemble_size=2", "reward.ensemble_trunks=own_sft"]).reward
    assert own.member_config() == RewardConfig()
    finetuned = ["sft.model=org/base", "sft.finetune=true", "sft.lr=1e-5"]
    assert load_config(None, [*finetuned, "reward.ensemble_size=2", "reward.ensemble_trunks=own_sft"]).reward == own
    cases = {
        (
            "reward.ensemble_models=[org/a, org/b]",
            "reward.ensemble_size=3",
        ): "reward.ensemble_models lists 2 models but "
        "reward.ensemble_size is 3: leave reward.ensemble_size out (the list's length is the ensemble size) or make "
        "the two agree",
        ("reward.ensemble_models=[]",): "reward.ensemble_models is empty: list the members' models, or leave the key "
        "out",
        ("reward.ensemble_models=[org/a, org/b]", "reward.ensemble_trunks=own_sft"): "reward.ensemble_trunks 'own_sft' "
        "trains the members from SFT checkpoints and reward.ensemble_models from the models it lists: set one of them",
        (
            "reward.ensemble_models=[org/a]",
            "reward.source=function",
            "reward.function=rlhf.data.synthetic:gold_reward",
        ): "reward.ensemble_models needs reward models to train: reward.source is 'function'",
        ("reward.ensemble_size=2", "reward.ensemble_trunks=own_sft", "sft.model=org/base"): "reward.ensemble_trunks "
        "'own_sft' has nothing to vary: sft.model (org/base) is used as it is (sft.finetune false); set sft.finetune "
        "true to fine-tune it anew for each member, or list the members' own models in reward.ensemble_models",
        ("reward.ensemble_trunks=separate",): "reward.ensemble_trunks",
    }
    for overrides, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, list(overrides))
        assert expected in str(err.value)
        assert str(err.value).count(". ") == 0, "one sentence"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_member_scores_the_text_in_its_own_tokens(tiny_checkpoints, family_checkpoint, tmp_path, dtype):
    """An ensemble of the policy's tokenizer's reward model, a Qwen2 and a Llama one (other tokenizers): in PPO's and
    the evaluation's scoring, each member's score of a sampled response is what that member alone gives the decoded
    text in its own tokens (the first member: the policy's token ids as they are); exactly in float32, within bf16's
    rounding under bf16 autocast (the members held in bf16, as a bf16 run holds them)."""
    from rlhf.models.device import DTYPES, autocast
    from rlhf.models.heads import sequence_scores
    from rlhf.models.loading import load_causal_lm, load_reward_model
    from rlhf.models.reward_ensemble import member_tokenizers
    from rlhf.ppo.models import load_models
    from rlhf.rollout.batching import encode_prompt_response, encode_prompts, pad_left
    from rlhf.rollout.generation import GenerationSettings
    from rlhf.rollout.scoring import ScoringModels, generate_and_score

    cpu = torch.device("cpu")
    paths = [tiny_checkpoints["reward"]]
    for k, family in enumerate(("qwen2", "llama"), 1):
        member = load_reward_model(str(family_checkpoint(family)), cpu)
        torch.manual_seed(k)
        torch.nn.init.normal_(member.score.weight, std=0.5)
        member.save_pretrained(tmp_path / family)
        load_tokenizer(str(family_checkpoint(family))).save_pretrained(tmp_path / family)
        paths.append(str(tmp_path / family))
    folder = tmp_path / "ensemble"
    folder.mkdir()
    EnsembleSpec(paths, [0.0, 0.0, 0.0], 0.1, ["a", "b", "c"]).write(folder)
    load_tokenizer(paths[0]).save_pretrained(folder)

    policy_tok = load_tokenizer(tiny_checkpoints["policy"])
    readers = member_tokenizers(str(folder), policy_tok)
    assert readers[0] is None and all(reader is not None for reader in readers[1:])
    assert readers[1].get_vocab() != readers[2].get_vocab() != policy_tok.get_vocab()
    cfg = PPOConfig(total_episodes=4, batch_size=4, num_mini_batches=1, max_new_tokens=10, record_rollouts=False)
    runtime = RuntimeConfig(device="cpu", dtype=dtype, progress=False)
    ppo_models = load_models(cfg, runtime, tiny_checkpoints["policy"], str(folder), None, cpu, RewardConfig())
    assert not ppo_models.same_tokenizer
    policy = load_causal_lm(tiny_checkpoints["policy"], cpu).eval()
    reward = load_reward(str(folder), cpu)
    evaluation = ScoringModels(policy, policy, reward, policy_tok, policy_tok, False, member_tokenizers=readers)
    prompts = sorted({d.prompt for d in synthetic.demonstrations(50, seed=1)})[:4]
    query, query_mask = pad_left(encode_prompts(policy_tok, prompts), policy_tok.pad_token_id)
    settings = GenerationSettings(
        10, 1.0, stop_token_ids=(policy_tok.eos_token_id,), pad_token_id=policy_tok.pad_token_id
    )
    for models in (ppo_models.scoring(), evaluation):
        with autocast(cpu, DTYPES[dtype]):
            scored = generate_and_score(models, query, query_mask, prompts, settings,
                                        torch.Generator().manual_seed(0), DTYPES[dtype])  # fmt: skip
        resp = scored.resp
        texts = policy_tok.batch_decode(resp.tokens.masked_fill(resp.mask == 0, policy_tok.pad_token_id),
                                        skip_special_tokens=True)  # fmt: skip
        assert scored.member_scores.shape == (3, len(prompts))
        with torch.no_grad():
            alone = [sequence_scores(load_reward_model(paths[0], cpu).eval(), scored.query_responses, scored.qr_mask)]
            for path in paths[1:]:
                batch = encode_prompt_response(load_tokenizer(path), prompts, texts, max_length=256)
                alone.append(
                    sequence_scores(load_reward_model(path, cpu).eval(), batch.input_ids, batch.attention_mask)
                )
        tolerance = 1e-5 if dtype == "float32" else 5e-2
        torch.testing.assert_close(scored.member_scores, torch.stack(alone).float(), atol=tolerance, rtol=tolerance)


def test_the_preflight_checks_the_listed_models(family_checkpoint, tmp_path):
    """Before anything trains: every listed model is a checkpoint that loads, and with sft.model and gae's separate
    value model (which starts from member 0) member 0 reads the policy's tokens."""
    from rlhf.preflight import check_ensemble_models

    llama, qwen2 = str(family_checkpoint("llama")), str(family_checkpoint("qwen2"))
    with pytest.raises(ConfigError, match=r"reward.ensemble_models\[1\]: checkpoint folder \./missing does not exist"):
        check_ensemble_models(load_config(None, [f"reward.ensemble_models=[{llama}, ./missing]"]))
    mixed = [f"sft.model={llama}", f"reward.ensemble_models=[{qwen2}, {llama}]"]
    with pytest.raises(ConfigError) as err:
        check_ensemble_models(load_config(None, mixed))
    assert str(err.value) == (
        f"reward.ensemble_models[0] ({qwen2}) has another tokenizer than sft.model ({llama}), and gae's value model "
        "starts from member 0 and scores every policy token: list a model with the policy's tokenizer first, or set "
        "ppo.value_model: policy_head or a critic-free ppo.advantage_estimator"
    )
    check_ensemble_models(load_config(None, [*mixed, "ppo.value_model=policy_head"]))
    check_ensemble_models(load_config(None, [f"sft.model={llama}", f"reward.ensemble_models=[{llama}, {qwen2}]"]))
