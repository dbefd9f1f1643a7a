"""Per-token KL estimators and KL-coefficient controllers.

Estimators of ``KL(policy || reference)`` from samples of the policy, on the log-ratio ``d = logp - ref_logp``
(Schulman, "Approximating KL divergence", 2020): k1 = ``d`` (unbiased, high variance, can be negative),
k2 = ``d^2 / 2`` (biased, low variance), k3 = ``exp(-d) - 1 + d`` (unbiased, non-negative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate from policy and reference log-probs of the sampled tokens.

    Shape: logprobs and ref_logprobs (b, t); output (b, t). Padded positions are not masked here.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d**2 / 2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"Unknown KL estimator {estimator!r}; allowed values are {', '.join(KL_ESTIMATORS)}.")


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Do nothing: the coefficient is constant."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.value = float(d["value"])


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019) steering the observed KL towards ``target``.

    ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update the coefficient after ``n_steps`` episodes whose mean sequence KL was ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.value = float(d["value"])
        self.target = float(d.get("target", self.target))
        self.horizon = int(d.get("horizon", self.horizon))


def make_kl_controller(
    kind: str, init: float, target: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller: ``"fixed"`` (constant ``init``) or ``"adaptive"`` (needs ``target`` and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(value=float(init))
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("The adaptive KL controller needs both a target KL and a horizon.")
        if target <= 0 or horizon <= 0:
            raise ValueError(f"The adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}.")
        return AdaptiveKLController(value=float(init), target=float(target), horizon=int(horizon))
    raise ValueError(f"Unknown KL controller kind {kind!r}; allowed values are fixed, adaptive.")
