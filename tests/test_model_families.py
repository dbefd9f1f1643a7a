"""Every stage on tiny checkpoints of the Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma-2, GPT-NeoX, OPT, Phi, Phi-3
and GPT-2 families (tests/model_zoo.py): SFT, reward model, PPO and evaluation, LoRA with default targets, the
policy-head value model, gradient checkpointing, stop tokens, log-probs and the first PPO ratio."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.config import EvalConfig, PPOConfig, RewardConfig, RuntimeConfig, SFTConfig
from rlhf.data import synthetic
from rlhf.eval.evaluate import evaluate_policies
from rlhf.models.heads import PolicyValueHead, sequence_scores, token_scores
from rlhf.models.loading import load_causal_lm, load_options, load_reward_model, load_tokenizer
from rlhf.models.stop_tokens import checkpoint_stop_tokens
from rlhf.models.training import adamw, is_gradient_checkpointing, unwrap
from rlhf.ppo import optimise as ppo_optimise
from rlhf.ppo import update as ppo_update
from rlhf.ppo.models import load_models, run_choices
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.state import load_state
from rlhf.ppo.trainer import PPOResult, generation_settings, train_ppo
from rlhf.rollout import scoring
from rlhf.rollout.batching import encode_prompt_response, encode_prompts, pad_left
from rlhf.rollout.forwards import policy_forward
from rlhf.rollout.generation import GenerationSettings, sample_responses
from rlhf.train.reward import train_reward_model
from rlhf.train.sft import finetune_sft
from tests.model_zoo import CHAT_FAMILIES, FAMILIES, SPECS, build_family

RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics: the tolerances below
CPU = torch.device("cpu")
PROMPTS = ["Review of The Silent River:", "Review of The Paper Horizon, a long and quiet one:"]


def _nolog(metrics, step):
    pass


def _ppo_cfg(**kw) -> PPOConfig:
    base = dict(
        total_episodes=4,
        batch_size=4,
        num_mini_batches=2,
        num_ppo_epochs=1,
        max_new_tokens=6,
        save_every=100,
        record_rollouts=False,
    )
    return PPOConfig(**{**base, **kw})


@dataclass
class Data:
    demos: Path
    train: Path
    eval: Path
    prompts: list[str]


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Data:
    root = tmp_path_factory.mktemp("family-data")
    demos = pd.DataFrame([{"prompt": d.prompt, "response": d.response} for d in synthetic.demonstrations(16, 0)])
    demos.to_parquet(root / "sft.parquet")
    for split, n in (("train", 8), ("eval", 4)):
        pairs = synthetic.preference_pairs(n, 0, 0.0, split)
        frame = pd.DataFrame([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs])
        frame.to_parquet(root / f"{split}.parquet")
    return Data(root / "sft.parquet", root / "train.parquet", root / "eval.parquet", sorted(set(demos["prompt"])))


@dataclass
class Stack:
    """One family's pipeline so far: the base checkpoint, its fine-tuned SFT policy, reward model, PPO result."""

    family: str
    root: Path
    base: str
    sft: str
    sft_losses: list[float]
    rm_path: str | None = None
    ppo: PPOResult | None = None


@pytest.fixture(scope="session")
def stacks(tmp_path_factory, data, family_checkpoint):
    """family -> its Stack, fine-tuned (SFT, with gradient checkpointing) on first use."""
    built: dict[str, Stack] = {}

    def get(family: str) -> Stack:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            base = str(family_checkpoint(family))
            losses: list[float] = []

            def log(metrics: dict[str, float], step: int) -> None:
                losses.extend(v for k, v in metrics.items() if k.endswith("loss"))

            cfg = SFTConfig(
                model=base,
                finetune=True,
                steps=3,
                batch_size=4,
                lr=3e-3,
                warmup_ratio=0,
                max_length=48,
                gradient_checkpointing=True,
            )
            sft = finetune_sft(cfg, RUNTIME, data.demos, root / "sft", 0, log)
            built[family] = Stack(family, root, base, sft.path, losses)
        return built[family]

    return get


def _rm(stack: Stack, data: Data) -> str:
    """The reward model trained from the SFT checkpoint (two steps), once per family."""
    if stack.rm_path is None:
        cfg = RewardConfig(epochs=1, batch_size=4, lr=1e-3, eval_every=100, max_length=48)
        result = train_reward_model(cfg, RUNTIME, stack.sft, data.train, data.eval, stack.root / "rm", 0, _nolog)
        stack.rm_path = result.path
    return stack.rm_path


def _ppo(stack: Stack, data: Data) -> PPOResult:
    """One PPO update (value model from the reward model, gradient checkpointing), once per family."""
    if stack.ppo is None:
        cfg = _ppo_cfg(gradient_checkpointing=True)
        rm = _rm(stack, data)
        stack.ppo = train_ppo(PolicyRun(cfg, RUNTIME, stack.sft, rm, data.prompts, stack.root / "ppo", 0, _nolog))
    return stack.ppo


# -- the stages ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_finetunes_the_family(stacks, family):
    stack = stacks(family)
    assert len(stack.sft_losses) >= 2 and all(math.isfinite(v) for v in stack.sft_losses)
    tuned = AutoModelForCausalLM.from_pretrained(stack.sft)
    base = AutoModelForCausalLM.from_pretrained(stack.base)
    assert tuned.config.model_type == SPECS[family].model_type
    assert tuned.dtype == torch.float32
    changed = [not torch.equal(a, b) for a, b in zip(tuned.parameters(), base.parameters(), strict=True)]
    assert sum(changed) > 0.9 * len(changed)
    assert tuned.generation_config.eos_token_id == base.generation_config.eos_token_id  # carried to later stages


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_model_trains_from_the_sft_checkpoint(stacks, data, family):
    path = _rm(stacks(family), data)
    config = AutoConfig.from_pretrained(path)
    assert config.num_labels == 1 and isinstance(config.pad_token_id, int)  # Llama 3: eos_token_id is a list
    rm = load_reward_model(path, CPU)
    tok = load_tokenizer(path)
    batch = encode_prompt_response(tok, PROMPTS, [" the plot was good.", " the cast was bad."], 48)
    with torch.no_grad():
        scores = sequence_scores(rm, batch.input_ids, batch.attention_mask)
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def _spy_prompts(monkeypatch, module) -> list[torch.Tensor]:
    """The left-padded prompt ids that `module.sample_responses` receives, row by row without padding."""
    seen: list[torch.Tensor] = []
    real = module.sample_responses

    def spy(model, prompt_ids, prompt_mask, *args, **kwargs):
        seen.extend(row[m.bool()] for row, m in zip(prompt_ids, prompt_mask, strict=True))
        return real(model, prompt_ids, prompt_mask, *args, **kwargs)

    monkeypatch.setattr(module, "sample_responses", spy)
    return seen


def _assert_bos_led(family: str, path: str, rows: list[torch.Tensor]) -> None:
    bos = load_tokenizer(path).bos_token_id
    assert rows and all((int(row[0]) == bos) == SPECS[family].style.add_bos for row in rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_ppo_trains_with_a_value_model_from_the_reward_model(stacks, data, family, monkeypatch):
    prompts = _spy_prompts(monkeypatch, scoring)  # PPO rollouts sample through rlhf.rollout.scoring
    stack = stacks(family)
    stack.ppo = None  # this test runs PPO (the evaluation test reuses the result)
    result = _ppo(stack, data)
    _assert_bos_led(family, stack.sft, prompts)
    assert result.updates == 1
    assert all(math.isfinite(v) for k, v in result.metrics.items() if k.startswith(("policy/", "value/")))
    policy = AutoModelForCausalLM.from_pretrained(result.policy_path)
    assert policy.config.model_type == SPECS[family].model_type
    assert AutoModelForSequenceClassification.from_pretrained(result.value_path).config.num_labels == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluation_compares_the_ppo_and_sft_policies(stacks, data, family, tmp_path, monkeypatch):
    stack = stacks(family)
    policy_path = _ppo(stack, data).policy_path
    prompts = _spy_prompts(monkeypatch, scoring)  # and so does evaluation
    result = evaluate_policies(
        EvalConfig(n_prompts=4, batch_size=4, max_new_tokens=6),
        _ppo_cfg(),
        RUNTIME,
        policy_path,
        stack.sft,
        _rm(stack, data),
        data.eval,
        tmp_path / "eval",
        synthetic.gold_score,
        _nolog,
    )
    assert result.summary["eval/n_prompts"] == 4
    _assert_bos_led(family, stack.sft, prompts)
    assert all(math.isfinite(v) for v in result.summary.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_default_targets_with_a_policy_head_value(stacks, data, family, tmp_path):
    stack = stacks(family)
    cfg = _ppo_cfg(value_model="policy_head", gradient_checkpointing=True, lora={"enabled": True, "r": 2, "alpha": 4})
    m = load_models(cfg, RUNTIME, stack.sft, _rm(stack, data), _rm(stack, data), CPU)
    assert isinstance(m.value, PolicyValueHead)
    assert is_gradient_checkpointing(unwrap(m.policy))
    adapted = {
        name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in m.policy.named_parameters() if "lora_A" in name
    }
    assert adapted, "LoRA adapted no module"
    targets = json.loads(run_choices(cfg, RUNTIME, stack.sft)["lora_target_modules_resolved"])
    if family == "phi3":  # peft has no default for Phi-3's fused projections: every linear layer
        assert targets == "all-linear" and {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} == adapted
    else:  # peft's default for the model type
        assert set(targets) == adapted
    logged = {}
    log = lambda stats, step: logged.update(stats)  # noqa: E731
    result = train_ppo(PolicyRun(cfg, RUNTIME, stack.sft, _rm(stack, data), data.prompts, tmp_path, 0, log))
    assert logged["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # B = 0: the policy is its reference at first
    assert math.isfinite(logged["policy/loss"]) and math.isfinite(logged["value/loss"])
    merged = AutoModelForCausalLM.from_pretrained(result.policy_path)
    assert merged.config.model_type == SPECS[family].model_type
    sft = AutoModelForCausalLM.from_pretrained(stack.sft).state_dict()
    moved = [key for key, value in merged.state_dict().items() if not torch.equal(value, sft[key])]
    assert moved and all(any(t in key for t in adapted) for key in moved)  # the adapters trained, through checkpoints


# -- invariants ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_first_minibatch_ratio_is_exactly_one(stacks, data, family):
    stack = stacks(family)
    cfg = _ppo_cfg(forward_batch_size=3, gradient_checkpointing=True)
    m = load_models(cfg, RUNTIME, stack.sft, _rm(stack, data), _rm(stack, data), CPU)
    assert is_gradient_checkpointing(m.policy) and is_gradient_checkpointing(m.value)
    state = load_state(stack.root / "no-state", m, cfg, 0, CPU)
    ids = encode_prompts(m.tokenizer, data.prompts, cfg.max_prompt_tokens)
    batch = prompt_batch(ids, 0, cfg.batch_size, 0, m.tokenizer.pad_token_id)
    settings = generation_settings(cfg, m)
    plan = ExecutionPlan.for_models(m)
    r = ppo_update.generate_and_score(m, batch, data.prompts, cfg, settings, state.sample_generator, plan)
    ppo_update.compute_advantages(r, cfg, state.kl_ctl.value)
    assert torch.allclose(r.scored.logprobs, r.scored.ref_logprobs, atol=1e-5)
    first = ppo_optimise.optimize(m, state, r, cfg, plan).minibatch_stats[0]
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["policy/approxkl"] < 1e-10
    assert first["policy/clipfrac"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_are_those_of_the_sampling_distribution(family_checkpoint, family):
    """policy_forward's log-probs equal log_softmax of the logits the sampler drew from (KV cache, left padding)
    and of the model's own full forward of each row alone (Gemma-2: with its final logit soft-cap)."""
    path = str(family_checkpoint(family))
    tok = load_tokenizer(path)
    policy = load_causal_lm(path, CPU).eval()
    with torch.no_grad():  # logits of a trained model's size (std ~2), where Gemma-2's soft-cap shows
        policy.get_output_embeddings().weight.mul_(20.0)
    ids, mask = pad_left(encode_prompts(tok, PROMPTS), tok.pad_token_id)
    step_logits = []
    hook = policy.register_forward_hook(lambda mod, args, out: step_logits.append(out.logits[:, -1].float()))
    settings = GenerationSettings(5, stop_token_ids=(), pad_token_id=tok.pad_token_id)
    resp = sample_responses(policy, ids, mask, settings, torch.Generator().manual_seed(0))
    hook.remove()
    qr, qr_mask = torch.cat([ids, resp.tokens], 1), torch.cat([mask, resp.mask], 1)
    with torch.no_grad():
        ours = policy_forward(policy, qr, qr_mask, ids.shape[1], 1.0).logprobs
        sampled = torch.stack(step_logits, 1).log_softmax(-1).gather(-1, resp.tokens[..., None]).squeeze(-1)
        torch.testing.assert_close(ours, sampled, atol=1e-4, rtol=1e-4)
        for row in range(len(ids)):
            real = qr[row][qr_mask[row].bool()]
            n_prompt = int(mask[row].sum())
            full = policy(real[None]).logits[0, n_prompt - 1 : -1].log_softmax(-1)
            expected = full.gather(-1, real[n_prompt:, None]).squeeze(-1)
            torch.testing.assert_close(ours[row], expected, atol=1e-4, rtol=1e-4)


# -- stop tokens and BOS -------------------------------------------------------------------------------------------


def _end_of_turn(family: str, tok) -> int:
    return tok.convert_tokens_to_ids(SPECS[family].style.end_of_turn)


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_chat_rollouts_stop_at_the_end_of_turn(stacks, data, family):
    stack = stacks(family)
    cfg = _ppo_cfg(max_new_tokens=8)
    m = load_models(cfg, RUNTIME, stack.sft, _rm(stack, data), _rm(stack, data), CPU)
    eot = _end_of_turn(family, m.tokenizer)
    assert eot in m.stop_token_ids and m.tokenizer.eos_token_id in m.stop_token_ids
    assert json.loads(run_choices(cfg, RUNTIME, stack.sft)["stop_token_ids"]) == list(m.stop_token_ids)
    # the model closes its turn at its third token: the response ends there
    calls = []

    def close_turn(module, args, logits):
        calls.append(1)
        if len(calls) >= 3:
            logits = logits.clone()
            logits[..., eot] += 100.0
        return logits

    hook = m.policy.get_output_embeddings().register_forward_hook(close_turn)
    chat = [
        m.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    ids, mask = pad_left(encode_prompts(m.tokenizer, chat), m.tokenizer.pad_token_id)
    resp = sample_responses(m.policy, ids, mask, generation_settings(cfg, m), torch.Generator().manual_seed(0))
    hook.remove()
    assert resp.contains_stop.all() and resp.tokens.shape[1] == 3
    assert (resp.tokens[:, 2] == eot).all() and resp.mask.sum(1).tolist() == [3, 3]


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_end_of_turn_is_found_from_the_chat_template_alone(family_checkpoint, family, tmp_path):
    """Without generation_config.json and with one EOS in config.json, the template still gives end-of-turn."""
    folder = tmp_path / family
    shutil.copytree(family_checkpoint(family), folder)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    tok = load_tokenizer(str(folder))
    config["eos_token_id"] = tok.eos_token_id
    (folder / "config.json").write_text(json.dumps(config))
    stops = checkpoint_stop_tokens(str(folder), [], trust_remote_code=False)
    assert set(stops) == {tok.eos_token_id, _end_of_turn(family, tok)}
    assert set(stops.values()) == {tok.eos_token, SPECS[family].style.end_of_turn}


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_start_with_one_bos_when_the_tokenizer_adds_one(family_checkpoint, family):
    tok = load_tokenizer(str(family_checkpoint(family)))
    bos = [tok.bos_token_id] if SPECS[family].style.add_bos else []
    texts = [PROMPTS[1]]
    if tok.chat_template:  # the Llama 3, Mistral and Gemma templates write the BOS text: no second BOS
        texts.append(tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], tokenize=False))
    full = encode_prompts(tok, texts)
    for row, text in zip(full, texts, strict=True):
        assert row[: len(bos)] == bos and row[len(bos)] != tok.bos_token_id, row
        assert tok.decode(row[len(bos) :]) == text.removeprefix(tok.bos_token or "")
    for row, whole in zip(encode_prompts(tok, texts, max_tokens=5), full, strict=True):  # left-truncated, BOS kept
        assert row == bos + whole[-(5 - len(bos)) :]
    # prompt + response rows: the BOS first, then as much of the response (and EOS) as fits
    long = " the plot was good and the cast was great and the music was superb."
    batch = encode_prompt_response(tok, texts, [long] * len(texts), max_length=8)
    assert all(row[: len(bos)] == bos for row in batch.input_ids.tolist())
    assert batch.loss_mask.sum(1).tolist() == [8 - len(bos)] * len(texts)


# -- dtype and classifier checkpoints ------------------------------------------------------------------------------


def test_a_bf16_checkpoint_trains_with_float32_master_weights(tmp_path):
    path = str(build_family("qwen2", tmp_path / "qwen2-bf16", dtype=torch.bfloat16))
    assert AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    frozen = load_causal_lm(path, CPU, **load_options(RuntimeConfig(dtype="bfloat16"), CPU, False))
    assert frozen.dtype == torch.bfloat16  # a frozen model: the runtime dtype
    model = load_causal_lm(path, CPU, **load_options(RUNTIME, CPU, trainable=True))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = adamw(model.parameters(), lr=1e-5)
    tok = load_tokenizer(path)
    ids = torch.tensor(encode_prompts(tok, [PROMPTS[1]]))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    embedding = model.get_input_embeddings().weight
    for name, p in model.named_parameters():
        if p is not embedding:  # only the rows of the prompt's tokens have a gradient there
            changed = (p.detach() != before[name]).float().mean().item()
            assert changed > 0.95, (name, changed)


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_stages_train_a_bf16_checkpoint_in_float32(data, tmp_path, stage):
    """One step at lr 1e-5 moves (nearly) every trunk weight: float32 master weights, not bf16 ones."""
    base = str(build_family("qwen2", tmp_path / "qwen2-bf16", dtype=torch.bfloat16))
    if stage == "sft":
        cfg = SFTConfig(model=base, finetune=True, steps=1, batch_size=8, lr=1e-5, warmup_ratio=0, max_length=48)
        trained = AutoModelForCausalLM.from_pretrained(
            finetune_sft(cfg, RUNTIME, data.demos, tmp_path / "sft", 0, _nolog).path
        )
    else:
        cfg = RewardConfig(epochs=1, batch_size=8, lr=1e-5, warmup_ratio=0.0, max_length=48)
        path = train_reward_model(cfg, RUNTIME, base, data.train, data.eval, tmp_path / "rm", 0, _nolog).path
        trained = AutoModelForSequenceClassification.from_pretrained(path)
    assert trained.dtype == torch.float32
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    layers = {k: v for k, v in trained.state_dict().items() if ".layers." in k}
    assert layers and all((v != original[k]).float().mean() > 0.9 for k, v in layers.items())


def test_reward_model_from_a_two_label_classifier(family_checkpoint, tmp_path, data):
    base = family_checkpoint("llama")
    config = AutoConfig.from_pretrained(base)
    config.num_labels = 2
    config.id2label, config.label2id = {0: "NEG", 1: "POS"}, {"NEG": 0, "POS": 1}
    config.problem_type = "single_label_classification"
    classifier = AutoModelForSequenceClassification.from_pretrained(base, config=config)
    classifier.save_pretrained(tmp_path / "classifier")
    load_tokenizer(str(base)).save_pretrained(tmp_path / "classifier")
    rm_cfg = RewardConfig(epochs=1, batch_size=4, lr=1e-3, eval_every=100, max_length=48)
    rm = train_reward_model(
        rm_cfg, RUNTIME, str(tmp_path / "classifier"), data.train, data.eval, tmp_path / "rm", 0, _nolog
    )
    saved = AutoConfig.from_pretrained(rm.path)
    assert saved.num_labels == 1 and saved.problem_type in (None, "regression") and len(saved.label2id) == 1
    reloaded = AutoModelForSequenceClassification.from_pretrained(rm.path)  # the next stage loads it as it is
    out = reloaded(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([0.5]))
    assert out.logits.shape == (1, 1) and torch.isfinite(out.loss)  # a regression loss on the scalar


def test_models_load_with_the_runtime_attention_implementation(family_checkpoint):
    def attn(family: str, runtime: RuntimeConfig, loader=load_causal_lm) -> str:
        model = loader(str(family_checkpoint(family)), CPU, **load_options(runtime, CPU, trainable=True))
        return model.config._attn_implementation

    assert attn("llama", RUNTIME) == "sdpa"
    assert attn("llama", RuntimeConfig(attn_implementation="eager")) == "eager"
    assert attn("llama", RuntimeConfig(attn_implementation="eager"), load_reward_model) == "eager"
    assert attn("gemma2", RUNTIME) == "eager"  # no sdpa kernel for soft-capped attention logits: eager


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_do_not_depend_on_left_padding(family_checkpoint, family):
    """Value and reward scores of a left-padded batch are those of each row alone (positions skip the padding)."""
    path = str(family_checkpoint(family))
    tok = load_tokenizer(path)
    model = load_reward_model(path, CPU).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.score.weight, std=1.0)
        ids, mask = pad_left(encode_prompts(tok, PROMPTS), tok.pad_token_id)
        batched = token_scores(model, ids, mask)
        for row in range(len(ids)):
            n = int(mask[row].sum())
            alone = token_scores(model, ids[row : row + 1, -n:], mask[row : row + 1, -n:])
            torch.testing.assert_close(batched[row, -n:], alone[0], atol=1e-4, rtol=1e-4)
