"""The evaluation stage's statistics: lengths, empty answers, win rates at equal length, hacking flags."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.summary import figure_rows, format_summary, name_the_policy
from rlhf.config import EvalConfig, PPOConfig, RuntimeConfig
from rlhf.data import synthetic
from rlhf.eval.evaluate import evaluate_policies, summarize
from rlhf.eval.length_control import EVAL_WARNING_TAG

POLICY_KEYS = ("length_mean", "length_p10", "length_p50", "length_p90", "empty_rate", "stop_rate")


def _frame(responses, scores, lengths, stopped=True):
    n = len(responses)
    return pd.DataFrame(
        {"response": responses, "score": scores, "kl": [0.0] * n, "length": lengths, "stopped": [stopped] * n}
    )


def test_summarize_flags_short_empty_answers_that_the_reward_model_prefers():
    """40 prompts: SFT answers 20 tokens; PPO answers 5 tokens (4 of them empty) and wins on reward-model score
    exactly where it is shorter, loses the matched ones; gold prefers SFT."""
    n = 40
    prompts = [f"p{i}" for i in range(n)]
    sft = _frame(["a long answer"] * n, [0.0] * n, [20] * n)
    ppo_len = [0] * 4 + [5] * 32 + [20] * 4  # 4 empty, 4 as long as SFT
    ppo_resp = [""] * 4 + ["short"] * 32 + ["a long answer too"] * 4
    ppo_scores = [3.0] * 4 + [1.0] * 32 + [-1.0] * 4  # the empty answers score best
    ppo = _frame(ppo_resp, ppo_scores, ppo_len)

    def gold(prompt, response, row=None):
        return float(len(response))

    table, summary, warnings = summarize(prompts, sft, ppo, gold, length_tolerance=0.2)
    assert list(table["policy_empty"]) == [True] * 4 + [False] * 36 and not table["sft_empty"].any()
    assert summary["eval/policy_length_mean"] == pytest.approx((32 * 5 + 4 * 20) / 40)
    assert summary["eval/policy_length_p50"] == 5.0 and summary["eval/sft_length_p90"] == 20.0
    assert summary["eval/policy_empty_rate"] == 0.1 and summary["eval/sft_empty_rate"] == 0.0
    assert summary["eval/policy_stop_rate"] == 1.0
    assert summary["eval/win_rate_rm"] == 0.9
    assert summary["eval/n_len_matched"] == 4.0
    assert summary["eval/win_rate_rm_len_matched"] == 0.0  # the 4 equal-length answers all lose
    assert summary["eval/win_rate_rm_len_controlled"] < 0.3
    assert summary["eval/win_rate_gold"] == 0.1 and summary["eval/win_rate_gold_len_matched"] == 1.0
    assert 0.0 <= summary["eval/win_rate_gold_len_controlled"] <= 1.0
    assert summary["eval/hacking_flag_length"] == 1.0 and summary["eval/hacking_flag_empty"] == 1.0
    assert len(warnings) == 2
    assert "reward-model score the trained policy wins 90%" in warnings[0] and "shorter (6.0 tokens" in warnings[0]
    assert "the trained policy answers nothing to 10.0% of prompts" in warnings[1]
    # the pipeline names the objective that trained it (GRPO, DPO, ...), never PPO for another one
    named = name_the_policy(warnings, "GRPO")
    assert "the GRPO policy wins 90%" in named[0] and named[1].startswith("the GRPO policy answers nothing")
    assert not any("PPO" in line or "trained policy" in line for line in named)


def test_a_verifiable_gold_gets_intervals_and_a_paired_gain_in_the_summary():
    """200 held-out items: SFT right on 80 (0.40), the trained policy on those 80 and 30 more (0.55). The paired
    interval of the gain is far narrower than the two means' intervals, because it resamples the same items."""
    n = 200
    prompts = [f"q{i}" for i in range(n)]
    right = {"sft": set(range(80)), "policy": set(range(110))}
    frames = {who: _frame([f"{who} {i}" for i in range(n)], [0.0] * n, [10] * n) for who in right}

    def correct(prompt, response, row=None):
        who, i = response.split()
        return float(int(i) in right[who])

    _, summary, _ = summarize(prompts, frames["sft"], frames["policy"], correct, length_tolerance=0.2)
    assert summary["eval/policy_gold"] == 0.55 and summary["eval/sft_gold"] == 0.40
    assert summary["eval/gold_gain"] == pytest.approx(0.15)
    for who, mean in (("policy", 0.55), ("sft", 0.40)):  # the binomial interval: about +-1.96 * sqrt(p(1-p)/n)
        half = 1.96 * np.sqrt(mean * (1 - mean) / n)
        assert summary[f"eval/gold_{who}_lo"] == pytest.approx(mean - half, abs=0.015)
        assert summary[f"eval/gold_{who}_hi"] == pytest.approx(mean + half, abs=0.015)
    # paired: the gain is 1 on 30 items and 0 elsewhere, so its interval is 0.15 +- 1.96 * sqrt(.15 * .85 / 200)
    half = 1.96 * np.sqrt(0.15 * 0.85 / n)
    assert summary["eval/gold_gain_lo"] == pytest.approx(0.15 - half, abs=0.015) and summary["eval/gold_gain_lo"] > 0
    assert summary["eval/gold_gain_hi"] == pytest.approx(0.15 + half, abs=0.015)
    printed = format_summary_rows(summary)
    assert "mean gold reward PPO / SFT" in printed and "0.550 [" in printed
    assert f"gain over SFT (paired 95% interval)  +0.150 [{summary['eval/gold_gain_lo']:+.3f}, " in printed


def format_summary_rows(summary: dict) -> str:
    return "\n".join(f"{what}  {value}" for what, value in figure_rows(summary))


def test_summarize_same_answers_no_flags():
    n = 20
    frame = _frame(["same answer"] * n, list(np.linspace(-1, 1, n)), [7] * n)
    _, summary, warnings = summarize([f"p{i}" for i in range(n)], frame, frame.copy(), None, 0.2)
    assert summary["eval/win_rate_rm"] == 0.0  # strict wins
    assert summary["eval/win_rate_rm_len_matched"] == 0.5 and summary["eval/n_len_matched"] == n  # ties half
    assert summary["eval/win_rate_rm_len_controlled"] == pytest.approx(0.5)
    assert "eval/win_rate_gold_len_controlled" not in summary
    assert summary["eval/hacking_flag_length"] == 0.0 and summary["eval/hacking_flag_empty"] == 0.0
    assert warnings == []


@pytest.fixture(scope="module")
def perturbed_policy(tiny_checkpoints, tmp_path_factory) -> str:
    """A 'PPO' checkpoint: the tiny policy with noise on its weights, so its answers differ from SFT's."""
    out = tmp_path_factory.mktemp("ppo") / "policy"
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["policy"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_checkpoints["policy"]).save_pretrained(out)
    return str(out)


def test_evaluate_policies_reports_lengths_empties_and_flags(tiny_checkpoints, perturbed_policy, tmp_path):
    prompts = list(dict.fromkeys(d.prompt for d in synthetic.demonstrations(200, seed=0)))[:24]
    eval_file = tmp_path / "eval.parquet"
    pd.DataFrame({"prompt": prompts}).to_parquet(eval_file)
    # a third of the vocabulary stops a response, so some responses are empty
    ppo_cfg = PPOConfig(max_new_tokens=6, max_prompt_tokens=32, stop_tokens=list(range(200, 300)))
    logged = []
    result = evaluate_policies(
        EvalConfig(n_prompts=24, batch_size=12, length_tolerance=0.5),
        ppo_cfg,
        RuntimeConfig(device="cpu", progress=False),
        perturbed_policy,
        tiny_checkpoints["policy"],
        tiny_checkpoints["reward"],
        eval_file,
        tmp_path / "eval",
        lambda prompt, response, row: float(len(response.split())),
        lambda metrics, step: logged.append(metrics),
    )
    s = result.summary
    assert logged == [s]
    for name in ("policy", "sft"):
        for key in POLICY_KEYS:
            assert f"eval/{name}_{key}" in s, key
    for key in ("eval/win_rate_rm_len_controlled", "eval/win_rate_gold_len_controlled", "eval/n_len_matched"):
        assert 0.0 <= s[key] <= 24
    assert s["eval/hacking_flag_length"] in (0.0, 1.0) and s["eval/hacking_flag_empty"] in (0.0, 1.0)
    assert isinstance(result.warnings, list)

    table = pd.read_parquet(result.completions)
    assert {"sft_length", "policy_length", "sft_empty", "policy_empty"} <= set(table.columns)
    for name in ("policy", "sft"):
        length, empty = table[f"{name}_length"], table[f"{name}_empty"]
        assert s[f"eval/{name}_empty_rate"] == pytest.approx(empty.mean())
        assert empty[length == 0].all()  # zero tokens before the stop token is empty
        assert (empty == ((length == 0) | (table[f"{name}_response"].str.strip() == ""))).all()
        assert s[f"eval/{name}_length_mean"] == pytest.approx(length.mean())
        assert s[f"eval/{name}_length_p50"] == pytest.approx(np.percentile(length, 50))
        assert length.max() <= 6
    assert table["policy_empty"].any() or table["sft_empty"].any()  # the stop tokens made some empty answers
    assert not (table["sft_response"] == table["policy_response"]).all()
    lp, ls = table["policy_length"], table["sft_length"]
    assert s["eval/n_len_matched"] == ((lp - ls).abs() <= 0.5 * np.maximum(lp, ls)).sum()


def _pipeline_summary(**extra) -> dict:
    summary = {
        "reward/best_eval_accuracy": 0.7,
        "eval/n_prompts": 256.0,
        "eval/win_rate_rm": 0.95,
        "eval/kl": 4.2,
        "eval/win_rate_rm_len_controlled": 0.52,
        "eval/win_rate_rm_len_matched": 0.5,
        "eval/n_len_matched": 40.0,
        "eval/hacking_flag_length": 0.0,
        "eval/hacking_flag_empty": 0.0,
        **{f"eval/policy_{k}": v for k, v in zip(POLICY_KEYS, (8.1, 0.0, 8.0, 14.0, 0.078, 0.99), strict=True)},
        **{f"eval/sft_{k}": v for k, v in zip(POLICY_KEYS, (23.0, 15.0, 23.0, 30.0, 0.0, 0.97), strict=True)},
        "mlflow_run_id": "abc",
        "tracking_uri": "sqlite:///mlruns/mlflow.db",
        **{k: f"/out/{k}" for k in ("data", "sft_checkpoint", "reward_checkpoint", "policy_checkpoint")},
        **{k: f"/out/{k}" for k in ("value_checkpoint", "completions")},
    }
    return summary | extra


def test_format_summary_shows_lengths_and_warnings():
    quiet = format_summary(_pipeline_summary())
    assert "WARNING" not in quiet
    assert "PPO response tokens:" in quiet and "mean 8.1, p10/p50/p90 0/8/14; empty 7.8%, stopped 99.0%" in quiet
    assert "mean 23.0, p10/p50/p90 15/23/30; empty 0.0%" in quiet
    assert "52.0% (logistic fit); 50.0% of 40 length-matched pairs" in quiet

    text = "PPO's gain over SFT is mostly explained by length: ...\nPPO answers nothing to 7.8% of prompts ..."
    loud = format_summary(
        _pipeline_summary(**{"eval/hacking_flag_length": 1.0, "eval/hacking_flag_empty": 1.0, EVAL_WARNING_TAG: text})
    )
    assert "WARNING: PPO's gain over SFT is mostly explained by length: ..." in loud
    assert "WARNING: PPO answers nothing to 7.8% of prompts ..." in loud
    generic = format_summary(_pipeline_summary(**{"eval/hacking_flag_length": 1.0}))  # a flag without its text
    assert "WARNING: PPO's gain over SFT is mostly explained by response length" in generic


def test_warning_reaches_the_pipeline_run_and_the_prefect_table(tmp_path, monkeypatch):
    import flows.artifacts
    from flows.pipeline_run import close_pipeline_run
    from rlhf.tracking.client import Tracker
    from tasks.tracking import TrackingContext

    text = "PPO's gain over SFT is mostly explained by length: ...\nPPO answers nothing to 7.8% of prompts ..."
    summary = _pipeline_summary(**{"eval/hacking_flag_length": 1.0, EVAL_WARNING_TAG: text})
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "e", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("pipeline")
    context = TrackingContext(uri=tracker.uri, experiment="e", parent_run_id=run_id)
    close_pipeline_run.fn(context, {k: v for k, v in summary.items() if k != "data"})  # no data files here
    run = tracker.get_run(run_id)
    assert run.data.tags[EVAL_WARNING_TAG] == text
    assert run.data.metrics["eval/hacking_flag_length"] == 1.0 and run.data.metrics["eval/policy_empty_rate"] == 0.078

    tables, markdowns = [], []
    monkeypatch.setattr(flows.artifacts, "link_mlflow_run", lambda *a, **k: None)
    monkeypatch.setattr(flows.artifacts, "create_table_artifact", lambda rows, **kw: tables.append((rows, kw)))
    monkeypatch.setattr(flows.artifacts, "create_markdown_artifact", lambda md, **kw: markdowns.append((md, kw)))
    flows.artifacts.publish_pipeline_results(summary, context)
    ((rows, kw),) = tables
    ((markdown, markdown_kw),) = markdowns
    # the sentences: in words in the evaluation's table, and opening both descriptions
    for line in text.splitlines():
        assert f"**WARNING:** {line}" in markdown
        assert f"WARNING: {line}" in kw["description"] and f"WARNING: {line}" in markdown_kw["description"]
    from rlhf.tracking.default_view import COLUMN_METRICS

    figures = [row["metric"] for row in rows if isinstance(row["value"], float)]
    key = [k for k in COLUMN_METRICS if k in figures]
    assert len(key) >= 3 and figures[: len(key)] == key, "the key figures first, in the MLflow view's order"
    assert {"metric": "eval/win_rate_rm_len_controlled", "value": 0.52} in rows
    assert {"metric": "eval/hacking_flag_length", "value": 1.0} in rows
    assert kw["description"].startswith("WARNING: PPO's gain over SFT is mostly explained by length")


def test_the_evaluation_stage_s_alarm_reads_the_reference_s_surprisal():
    """The final policy against the SFT policy: diverse, well-formed answers whose tokens the SFT model finds 1.4
    nats more surprising each raise the flag; 1.2 nats more do not; eval/<policy>_ref_surprisal is logged."""
    from rlhf.eval.evaluate import overoptimisation_signs

    def frame(nll_per_token: float) -> pd.DataFrame:
        responses = [f"the plot was good and the cast was fine {i}" for i in range(20)]
        out = _frame(responses, [0.0] * 20, [10] * 20)
        return out.assign(ref_nll=[10.0 * nll_per_token] * 20, tokens=[10] * 20)

    sft = frame(1.0)
    summary, warnings = overoptimisation_signs(sft, frame(2.4), 0.0)
    assert summary["eval/sft_ref_surprisal"] == pytest.approx(1.0)
    assert summary["eval/policy_ref_surprisal"] == pytest.approx(2.4)
    assert summary["eval/overoptimisation_flag"] == 1.0 and "1.40 nats more surprising" in warnings[0]
    summary, warnings = overoptimisation_signs(sft, frame(2.2), 0.0)
    assert summary["eval/overoptimisation_flag"] == 0.0 and warnings == []
