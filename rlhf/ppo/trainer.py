"""The PPO training loop (RLHF_SPEC.md, "One PPO update"), resumable from its last saved state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from rlhf import models
from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.ops import gae, masked_mean, masked_whiten, per_token_rewards, policy_loss, shape_scores, value_loss
from rlhf.ppo.rollout import GenerationSettings, policy_forward, sample_responses, value_forward
from rlhf.ppo.state import PPOModels, TrainerState, load_models, load_state, prompt_batch, save_state, score_responses
from rlhf.ppo.stats import OptimStats, peak_memory_mb, rollout_stats

LogFn = Callable[[dict[str, float], int], None]
GoldFn = Callable[[str, str], float]


@dataclass
class PPOResult:
    policy_path: str
    value_path: str
    digest: str
    updates: int
    metrics: dict[str, float] = field(default_factory=dict)


def _chunks(n: int, size: int | None):
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def train_ppo(
    cfg: PPOConfig,
    runtime: RuntimeConfig,
    policy_path: str,
    reward_path: str,
    prompts: list[str],
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    value_path: str | None = None,
    gold_fn: GoldFn | None = None,
    stop_after: int | None = None,
) -> PPOResult:
    """Train the policy with PPO against the reward model; resumes from ``out_dir/state`` when it exists.

    `stop_after` ends the run after that many updates (as if interrupted), for resume tests.
    """
    out_dir = Path(out_dir)
    device = models.resolve_device(runtime.device)
    m: PPOModels = load_models(cfg, runtime, policy_path, reward_path, value_path or reward_path, device)
    state: TrainerState = load_state(out_dir / "state", m, cfg, seed, device)
    settings = GenerationSettings(
        cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, m.stop_token_ids, m.tokenizer.pad_token_id
    )
    prompt_ids = [ids[-cfg.max_prompt_tokens :] for ids in m.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    total = cfg.num_updates
    last_stats: dict[str, float] = {}
    bar = tqdm(range(state.step, total), desc="ppo", disable=not runtime.progress, initial=state.step, total=total)
    for update in bar:
        t0 = time.perf_counter()
        # step 1. sample a batch of prompts and generate responses
        batch = prompt_batch(prompt_ids, update, cfg.batch_size, seed, m.tokenizer.pad_token_id)
        query, query_mask = batch.ids.to(device), batch.mask.to(device)
        p = query.shape[1]
        with models.autocast(device, runtime.bf16):
            resp = sample_responses(m.policy, query, query_mask, settings, state.sample_generator)
        query_responses = torch.cat([query, resp.tokens], 1)
        qr_mask = torch.cat([query_mask, resp.mask], 1)
        mask = resp.mask.float()
        t1 = time.perf_counter()

        # step 2. log-probs, reference log-probs, values and reward-model scores (no grad)
        with torch.no_grad(), models.autocast(device, runtime.bf16):
            parts = [
                (
                    policy_forward(m.policy, query_responses[s], qr_mask[s], p, cfg.temperature).logprobs,
                    policy_forward(m.reference, query_responses[s], qr_mask[s], p, cfg.temperature).logprobs,
                    value_forward(m.value, query_responses[s], qr_mask[s], p),
                )
                for s in _chunks(len(query), cfg.forward_batch_size)
            ]
            logprobs, ref_logprobs, values = (torch.cat(x).float() for x in zip(*parts, strict=True))
            scores = score_responses(m, batch.indices, prompts, query_responses, qr_mask, resp, cfg, device)
        t2 = time.perf_counter()

        # step 3. shaped scores and per-token rewards (KL penalty at every token, score at the last)
        shaped = shape_scores(
            scores,
            resp.mask.sum(1),
            resp.contains_stop,
            clip=cfg.score_clip,
            missing_stop_penalty=cfg.missing_eos_penalty,
            missing_stop_mode=cfg.missing_eos_mode,
            min_length=cfg.min_response_length,
            min_length_penalty=cfg.min_length_penalty,
        )
        tr = per_token_rewards(shaped.scores, logprobs, ref_logprobs, mask, state.kl_ctl.value, cfg.kl_estimator)
        rewards = masked_whiten(tr.rewards, mask, restore_mean=False) if cfg.whiten_rewards else tr.rewards

        # step 4. advantages and returns (GAE), whitened advantages for the loss
        adv = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        advantages = masked_whiten(adv.advantages, mask) if cfg.whiten_advantages else adv.advantages
        t3 = time.perf_counter()

        # step 5. PPO epochs over shuffled minibatches
        optim = OptimStats()
        stopped_early = 0.0
        for _epoch in range(cfg.num_ppo_epochs):
            perm = torch.randperm(cfg.batch_size, generator=state.shuffle_generator)
            for start in range(0, cfg.batch_size, cfg.mini_batch_size):
                mb_idx = perm[start : start + cfg.mini_batch_size]
                for micro in mb_idx.split(cfg.mini_batch_size // cfg.gradient_accumulation_steps):
                    micro = micro.to(device)
                    with models.autocast(device, runtime.bf16):
                        out = policy_forward(
                            m.policy, query_responses[micro], qr_mask[micro], p, cfg.temperature, with_entropy=True
                        )
                        new_values = value_forward(m.value, query_responses[micro], qr_mask[micro], p).float()
                    mb_mask = mask[micro]
                    pl = policy_loss(out.logprobs, logprobs[micro], advantages[micro], mb_mask, cfg.cliprange)
                    vl = value_loss(new_values, values[micro], adv.returns[micro], mb_mask, cfg.cliprange_value)
                    entropy = masked_mean(out.entropy, mb_mask)
                    loss = pl.loss + cfg.vf_coef * vl.loss - cfg.entropy_coef * entropy
                    (loss / cfg.gradient_accumulation_steps).backward()
                    optim.add(
                        {
                            "policy/loss": pl.loss,
                            "value/loss": vl.loss,
                            "loss/total": loss,
                            "policy/entropy": entropy,
                            "policy/approxkl": pl.approx_kl,
                            "policy/policykl": pl.policy_kl,
                            "policy/clipfrac": pl.clipfrac,
                            "policy/ratio_mean": pl.ratio_mean,
                            "policy/ratio_var": pl.ratio_var,
                            "value/clipfrac": vl.clipfrac,
                            "value/error": vl.value_error,
                        }
                    )
                optim.add(
                    {
                        "policy/grad_norm": torch.nn.utils.clip_grad_norm_(m.policy.parameters(), cfg.max_grad_norm),
                        "value/grad_norm": torch.nn.utils.clip_grad_norm_(m.value.parameters(), cfg.max_grad_norm),
                    }
                )
                state.policy_opt.step()
                state.value_opt.step()
                state.policy_opt.zero_grad(set_to_none=True)
                state.value_opt.zero_grad(set_to_none=True)
            if cfg.target_kl is not None and optim.means()["policy/approxkl"] > cfg.target_kl:
                stopped_early = 1.0
                break
        state.policy_sched.step()
        state.value_sched.step()
        t4 = time.perf_counter()

        # step 6. KL controller, statistics, records, checkpoint
        stats = rollout_stats(
            scores=scores,
            shaped_scores=shaped.scores,
            contains_stop=resp.contains_stop,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            kl=tr.kl,
            non_score_rewards=tr.non_score_rewards,
            response_mask=mask,
            query_lengths=query_mask.sum(1),
            advantages=adv.advantages,
            returns=adv.returns,
            values=values,
            kl_coef=state.kl_ctl.value,
        )
        stats.update(optim.means())
        state.kl_ctl.update(stats["objective/kl"], cfg.batch_size)
        records = None
        if cfg.record_rollouts or gold_fn is not None:
            records = _records(m, update, batch.indices, prompts, resp, scores, shaped.scores, tr.kl, gold_fn)
            if gold_fn is not None:
                stats["objective/gold_score"] = float(records["gold_score"].mean())
        t5 = time.perf_counter()
        n_tokens = int(mask.sum().item())
        stats.update(
            {
                "policy/lr": state.policy_sched.get_last_lr()[0],
                "value/lr": state.value_sched.get_last_lr()[0],
                "policy/early_stopped": stopped_early,
                "time/generate": t1 - t0,
                "time/score": t2 - t1,
                "time/advantages": t3 - t2,
                "time/optimize": t4 - t3,
                "time/stats": t5 - t4,
                "time/total": t5 - t0,
                "speed/episodes_per_s": cfg.batch_size / (t5 - t0),
                "speed/tokens_per_s": n_tokens / (t5 - t0),
                "memory/peak_mb": peak_memory_mb(device),
            }
        )
        state.step = update + 1
        if cfg.record_rollouts and records is not None:
            (out_dir / "rollouts").mkdir(parents=True, exist_ok=True)
            records.to_parquet(out_dir / "rollouts" / f"update_{update:05d}.parquet", index=False)
        if update % cfg.log_every == 0 or state.step == total:
            log(stats, state.step)
        last_stats = stats
        bar.set_postfix(score=f"{stats['objective/scores']:.2f}", kl=f"{stats['objective/kl']:.2f}", refresh=False)
        if state.step % cfg.save_every == 0 and state.step < total:
            save_state(out_dir / "state", m, state)
        if stop_after is not None and state.step >= stop_after and state.step < total:
            save_state(out_dir / "state", m, state)
            raise InterruptedError(f"stopped after {state.step} updates (stop_after)")
    return _save_final(out_dir, m, state, last_stats)


def _records(
    m: PPOModels, update: int, indices: list[int], prompts: list[str], resp, scores, shaped, kl, gold_fn: GoldFn | None
) -> pd.DataFrame:
    responses = m.tokenizer.batch_decode(
        resp.tokens.masked_fill(resp.mask == 0, m.tokenizer.pad_token_id), skip_special_tokens=True
    )
    frame = pd.DataFrame(
        {
            "update": update,
            "prompt": [prompts[i] for i in indices],
            "response": responses,
            "score": scores.cpu().numpy(),
            "shaped_score": shaped.cpu().numpy(),
            "kl": kl.sum(1).cpu().numpy(),
            "response_len": resp.mask.sum(1).cpu().numpy(),
            "contains_stop": resp.contains_stop.cpu().numpy(),
        }
    )
    if gold_fn is not None:
        frame["gold_score"] = [gold_fn(p, r) for p, r in zip(frame["prompt"], frame["response"], strict=True)]
    return frame


def _save_final(out_dir: Path, m: PPOModels, state: TrainerState, stats: dict[str, float]) -> PPOResult:
    final = out_dir / "final"
    with atomic_dir(final) as tmp:
        m.policy.save_pretrained(tmp / "policy", safe_serialization=True)
        m.tokenizer.save_pretrained(tmp / "policy")
        m.value.save_pretrained(tmp / "value", safe_serialization=True)
        m.value_tokenizer.save_pretrained(tmp / "value")
        manifest = write_manifest(tmp, stage="ppo", updates=state.step)
    return PPOResult(str(final / "policy"), str(final / "value"), manifest["digest"], state.step, stats)
