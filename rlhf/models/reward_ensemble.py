"""Reward-model ensembles: K reward models trained alike with their own seeds (and, with reward.bootstrap, their
own resample of the pairs), from the SFT checkpoint, from SFT checkpoints of their own (reward.ensemble_trunks
'own_sft') or from models of their own (reward.ensemble_models), scored together (docs/overoptimisation.md).

An ensemble is a folder with `ENSEMBLE_FILE` (the members' checkpoint folders, each member's offset and the
members' disagreement on held-out chosen responses, written by `rlhf.train.reward_ensemble`), member 0's tokenizer
and a manifest; each member's own tokenizer is in its folder (`member_tokenizers`). `load_reward` loads it as a
`RewardEnsemble`, or a single reward model's folder as that model: the stages downstream of the reward model take
either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.config import RewardConfig
from rlhf.models.loading import load_reward_model, load_tokenizer
from rlhf.models.stop_tokens import same_vocabulary
from rlhf.ops import ensemble_scores

ENSEMBLE_FILE = "ensemble.json"


@dataclass
class EnsembleSpec:
    """What `ENSEMBLE_FILE` holds."""

    members: list[str]  # the members' checkpoint folders, member 0 first
    offsets: list[float]  # each member's mean score on the held-out responses less the members' average of those
    in_distribution_std: float  # the members' std (after the offsets) on held-out chosen responses, mean over pairs
    member_digests: list[str]  # the members' content digests (so the ensemble's digest is theirs too)

    def write(self, folder: Path) -> None:
        (folder / ENSEMBLE_FILE).write_text(json.dumps(asdict(self), indent=1))


def read_ensemble(path: str | Path) -> EnsembleSpec | None:
    """The ensemble at `path`, or None where `path` is a single reward model."""
    file = Path(path) / ENSEMBLE_FILE
    return EnsembleSpec(**json.loads(file.read_text())) if file.is_file() else None


def member_paths(path: str) -> list[str]:
    """The checkpoint folders of the reward model(s) at `path`: the members of an ensemble, else `path` itself."""
    spec = read_ensemble(path)
    return spec.members if spec is not None else [path]


def member_tokenizers(
    path: str, policy_tokenizer: PreTrainedTokenizerBase, trust_remote_code: bool = False
) -> list[PreTrainedTokenizerBase | None]:
    """For each model that scores at `path` (an ensemble's members, or the one reward model), the tokenizer it
    re-tokenizes the policy's decoded text with; None where its vocabulary is the policy's, so it scores the policy's
    token ids as they are."""
    tokenizers = [load_tokenizer(member, trust_remote_code=trust_remote_code) for member in member_paths(path)]
    return [None if same_vocabulary(policy_tokenizer, tok) else tok for tok in tokenizers]


class RewardEnsemble(nn.Module):
    """K frozen reward models. `member_scores` are their scores less each member's offset, so the members agree
    on average over held-out responses; `combine` makes one score of them with the ensemble objective."""

    def __init__(
        self, members: list[PreTrainedModel], spec: EnsembleSpec, objective: str = "mean", uncertainty_coef: float = 0.0
    ) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.register_buffer("offsets", torch.tensor(spec.offsets, dtype=torch.float32), persistent=False)
        self.in_distribution_std = spec.in_distribution_std
        self.objective = objective
        self.uncertainty_coef = uncertainty_coef

    @property
    def config(self) -> Any:
        """Member 0's config (members of reward.ensemble_models have architectures of their own)."""
        return self.members[0].config

    def centred(self, raw: Tensor) -> Tensor:
        """Raw member scores less the members' offsets. Shape: (K, b) -> (K, b)."""
        return raw.float() - self.offsets.to(raw.device)[:, None]

    def combine(self, member_scores: Tensor) -> Tensor:
        """The ensemble objective's score of centred member scores. Shape: (K, b) -> (b,)."""
        return ensemble_scores(member_scores, self.objective, self.uncertainty_coef)


def load_reward(
    path: str, device: torch.device, objective: str = "mean", uncertainty_coef: float = 0.0, **options: Any
) -> PreTrainedModel | RewardEnsemble:
    """The frozen reward model at `path`: a `RewardEnsemble` where `path` is an ensemble's folder, else the reward
    model itself (`options`: `load_reward_model`'s)."""
    spec = read_ensemble(path)
    if spec is None:
        model = load_reward_model(path, device, **options)
    else:
        members = [load_reward_model(member, device, **options) for member in spec.members]
        model = RewardEnsemble(members, spec, objective, uncertainty_coef).to(device)
    model.requires_grad_(False)
    return model.eval()


def in_distribution_std(reward: nn.Module | None) -> float:
    """An ensemble's members' disagreement on held-out chosen responses (`EnsembleSpec`); 0 for one reward model or
    none (a reward function)."""
    return reward.in_distribution_std if isinstance(reward, RewardEnsemble) else 0.0


def ensemble_objective(reward_cfg: RewardConfig | None) -> tuple[str, float]:
    """The ensemble objective and its uncertainty coefficient of a reward config section (None: the mean)."""
    if reward_cfg is None:
        return "mean", 0.0
    return reward_cfg.ensemble_objective, reward_cfg.uncertainty_coef


def reward_members(reward: nn.Module) -> list[nn.Module]:
    """The models that score: an ensemble's members, or the one reward model."""
    return list(reward.members) if isinstance(reward, RewardEnsemble) else [reward]
