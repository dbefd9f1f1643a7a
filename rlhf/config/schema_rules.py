"""The PPO batch rules as JSON Schema clauses, for a form that is validated against its schema alone.

Prefect's server checks a run's parameters against the deployment's JSON schema (when the run is created, and in the
UI when the form is validated); it does not run pydantic validators. JSON Schema cannot compare two fields, but it
can say ``if num_mini_batches is 3 then batch_size is a multiple of 3``. :func:`ppo_batch_clauses` writes the rules of
``PPOConfig._batches_divide`` that way for a form with:

* a config drop-down (``config_file``; ``config_path`` empty), each shipped config's own values known here,
* three optional typed fields (``ppo.total_episodes``, ``ppo.batch_size``, ``ppo.num_mini_batches``; null: the
  config file's value), whose keys the free-text ``overrides`` may not set (nor the whole ``ppo`` section),
* ``ppo.gradient_accumulation_steps`` from the config file, or from an override (then only checked by the run).

Rules: ``num_mini_batches * gradient_accumulation_steps`` divides ``batch_size``; ``total_episodes >= batch_size``.
Every clause is implied by the rules (the schema never refuses a valid run). It refuses every invalid combination of
a shipped config with these fields and ``num_mini_batches <= MAX_MINI_BATCHES``, except ``total_episodes`` below
``batch_size`` when both are typed and ``batch_size`` is not a power of two or three times one (it then checks the
nearest such value below); a config given by path is checked for the rules between the typed fields only. What the
schema lets through is still refused by the run's own validation, with the pydantic sentence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlhf.config.estimators import GROUP_ESTIMATORS
from rlhf.config.ppo import PPOConfig

MAX_MINI_BATCHES = 128  # the form's bound on ppo.num_mini_batches: the schema enumerates the values up to it
# typed fields of the form (ppo.<key>): the batch fields, then the estimator and its group size
FORM_KEYS = ("total_episodes", "batch_size", "num_mini_batches", "advantage_estimator", "samples_per_prompt")
MAX_GROUP = 64  # the form's bound on ppo.samples_per_prompt: the schema enumerates the values up to it
# overrides that would change what the typed fields say: the whole ppo section, or one of their keys
FIELD_OVERRIDE = rf"^ppo(\.({'|'.join(FORM_KEYS)}))?="
ACCUMULATION_OVERRIDE = r"^ppo(\.gradient_accumulation_steps)?="
BREAKPOINTS = sorted({m << e for m in (1, 3) for e in range(21)})  # batch sizes where total >= batch is exact


def field_name(key: str) -> str:
    """The form's property of ``ppo.<key>``."""
    return f"ppo_{key}"


def overrides_set_a_field(overrides: list[str]) -> str | None:
    """The first override that sets a typed field's key (or the whole ppo section), if any."""
    return next((o for o in overrides if re.match(FIELD_OVERRIDE, o.strip().replace(" ", ""))), None)


def _is(name: str, value: int) -> dict[str, Any]:
    return {"properties": {name: {"const": value}}, "required": [name]}


def _given(name: str) -> dict[str, Any]:
    return {"properties": {name: {"type": "integer"}}, "required": [name]}


def _empty(name: str) -> dict[str, Any]:
    return {"properties": {name: {"type": "null"}}}  # null or absent


def _config(name: str, default: str) -> dict[str, Any]:
    """The config file `name` is the one in effect (no config_path; an absent config_file is the default)."""
    chosen: dict[str, Any] = {"properties": {"config_file": {"const": name}}, "required": ["config_file"]}
    if name == default:
        chosen = {"anyOf": [chosen, {"not": {"required": ["config_file"]}}]}
    return {"allOf": [{"properties": {"config_path": {"const": ""}}}, chosen]}


NO_ACCUMULATION_OVERRIDE = {
    "not": {"properties": {"overrides": {"contains": {"pattern": ACCUMULATION_OVERRIDE}}}, "required": ["overrides"]}
}


def _when(conditions: list[dict[str, Any]], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": conditions[0] if len(conditions) == 1 else {"allOf": conditions}, "then": then}


def _constrain(name: str, **schema: Any) -> dict[str, Any]:
    return {"properties": {name: schema}}


def ppo_batch_clauses(configs: Mapping[str, PPOConfig], default: str) -> list[dict[str, Any]]:
    """``allOf`` clauses of the form's schema: the PPO batch rules over the typed fields and the shipped configs'
    values (`configs`: config_file choice -> its ppo section; `default`: the choice an absent config_file means)."""
    total, batch, minis = (field_name(k) for k in ("total_episodes", "batch_size", "num_mini_batches"))
    ks = range(1, MAX_MINI_BATCHES + 1)
    clauses = [_when([_is(minis, k)], _constrain(batch, multipleOf=k)) for k in ks if k > 1]
    clauses += [
        _when([_given(batch), {"properties": {batch: {"minimum": x}}}], _constrain(total, minimum=x))
        for x in BREAKPOINTS
    ]
    by_accumulation: dict[int, list[str]] = {}
    for name, ppo in configs.items():
        by_accumulation.setdefault(ppo.gradient_accumulation_steps, []).append(name)
        here = _config(name, default)
        # one of the fields typed, the others from the config file
        divisors = [k for k in ks if ppo.batch_size % k == 0]
        clauses.append(_when([here, _empty(batch), _given(minis)], _constrain(minis, enum=divisors)))
        clauses.append(_when([here, _empty(minis)], _constrain(batch, multipleOf=ppo.num_mini_batches)))
        clauses.append(_when([here, _empty(batch)], _constrain(total, minimum=ppo.batch_size)))
        clauses.append(_when([here, _empty(total)], _constrain(batch, maximum=ppo.total_episodes)))
        accumulation = ppo.gradient_accumulation_steps
        if accumulation > 1:  # the minibatch must split into the config's micro-batches (unless overridden)
            fitting = [k for k in divisors if (ppo.batch_size // k) % accumulation == 0]
            unchanged = [here, NO_ACCUMULATION_OVERRIDE]
            clauses.append(_when([*unchanged, _empty(batch), _given(minis)], _constrain(minis, enum=fitting)))
            step = ppo.num_mini_batches * accumulation
            clauses.append(_when([*unchanged, _empty(minis)], _constrain(batch, multipleOf=step)))
    for accumulation, names in sorted(by_accumulation.items()):
        if accumulation > 1:  # both fields typed: batch a multiple of minis * the config's accumulation steps
            chosen = {"anyOf": [_config(name, default) for name in names]}
            steps = [_when([_is(minis, k)], _constrain(batch, multipleOf=k * accumulation)) for k in ks]
            clauses.append(_when([chosen, NO_ACCUMULATION_OVERRIDE], {"allOf": steps}))
    return clauses


def group_clauses(configs: Mapping[str, PPOConfig], default: str) -> list[dict[str, Any]]:
    """``allOf`` clauses of the estimator's group rules: ppo.samples_per_prompt divides ppo.batch_size (typed, or the
    chosen config file's), and a group estimator (`GROUP_ESTIMATORS`) has 2 or more
    samples a prompt (typed, or the config file's)."""
    estimator, group, batch = (field_name(k) for k in ("advantage_estimator", "samples_per_prompt", "batch_size"))
    grouped = {"properties": {estimator: {"enum": list(GROUP_ESTIMATORS)}}, "required": [estimator]}
    clauses = [_when([_is(group, k), _given(batch)], _constrain(batch, multipleOf=k)) for k in range(2, MAX_GROUP + 1)]
    clauses.append(_when([grouped, _given(group)], _constrain(group, minimum=2)))
    for name, ppo in configs.items():
        here = _config(name, default)
        divisors = [k for k in range(1, MAX_GROUP + 1) if ppo.batch_size % k == 0]
        clauses.append(_when([here, _empty(batch), _given(group)], _constrain(group, enum=divisors)))
        if ppo.samples_per_prompt < 2:  # the config's one sample a prompt cannot feed a group estimator
            clauses.append(_when([here, grouped, _empty(group)], _given(group)))
    return clauses
