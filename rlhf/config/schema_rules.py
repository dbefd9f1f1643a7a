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

A broken rule shows on one field, once, as what that field expects, naming the setting that decides it and, where
the config file holds it, its value there: ``'a divisor of ppo.batch_size (16 in conf/smoke.yaml): 1, 2, 4, 8 or 16'
was expected``, ``'2 or more: ppo.advantage_estimator grpo compares the samples of a prompt (conf/smoke.yaml has 1)'
was expected`` (`_expect`: JSON Schema has no messages of its own, but ``const`` names its value).
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
# where the typed fields' keys are set (the run's own validation and the form's schema say it)
IN_THEIR_FIELDS = f"set ppo.{', '.join(FORM_KEYS[:-1])} and {FORM_KEYS[-1]} in their fields"
FIELD_OVERRIDE_EXPECTED = f"an override of another key ({IN_THEIR_FIELDS})"  # the form's message (`_expect`)
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


def _breaks(name: str, **allowed: Any) -> dict[str, Any]:
    """The field `name` is given (an integer) and its value is not `allowed`."""
    return {"properties": {name: {"type": "integer", "not": allowed}}, "required": [name]}


def _expect(conditions: list[dict[str, Any]], name: str, expected: str) -> dict[str, Any]:
    """Where `conditions` hold (a rule broken), the field `name` shows ``'<expected>' was expected``.

    JSON Schema's error messages are fixed templates that name the value and the bound ("3 is not one of [1, 2, 4,
    8, 16]"); Prefect's UI shows them on the field as they are. ``const`` names its own value, so a ``const`` no
    integer meets, in the branch a broken rule takes, carries the rule's sentence to the field: what to type, and
    which setting decides it."""
    return _when(conditions, _constrain(name, const=expected))


def _constrain(name: str, **schema: Any) -> dict[str, Any]:
    return {"properties": {name: schema}}


def _listed(values: list[int]) -> str:
    """'1, 2, 4, 8 or 16'."""
    text = ", ".join(str(v) for v in values)
    return text.rsplit(", ", 1)[0] + f" or {values[-1]}" if len(values) > 1 else text


def _between(name: str, low: int, high: int | None) -> dict[str, Any]:
    """The field `name` is given, at least `low` and under `high` (None: no bound)."""
    bounds = {"minimum": low} | ({"exclusiveMaximum": high} if high is not None else {})
    return {"properties": {name: {"type": "integer", **bounds}}, "required": [name]}


def ppo_batch_clauses(configs: Mapping[str, PPOConfig], default: str) -> list[dict[str, Any]]:
    """``allOf`` clauses of the form's schema: the PPO batch rules over the typed fields and the shipped configs'
    values (`configs`: config_file choice -> its ppo section; `default`: the choice an absent config_file means).
    A broken rule shows on one field, once, as what that field expects (`_expect`)."""
    total, batch, minis = (field_name(k) for k in ("total_episodes", "batch_size", "num_mini_batches"))
    ks = range(1, MAX_MINI_BATCHES + 1)
    clauses = [
        _expect([_is(minis, k), _breaks(batch, multipleOf=k)], batch, f"a multiple of ppo.num_mini_batches ({k})")
        for k in ks
        if k > 1
    ]
    # total >= batch where both are typed, exact at the breakpoints: one clause per breakpoint and one per range
    # between two (total >= the breakpoint below), so a short total is one error on its field
    for low, high in zip(BREAKPOINTS, [*BREAKPOINTS[1:], None], strict=True):
        exact = [_between(batch, low, low + 1), _breaks(total, minimum=low)]
        clauses.append(_expect(exact, total, f"at least ppo.batch_size ({low})"))
        if high != low + 1:
            above = [_between(batch, low + 1, high), _breaks(total, minimum=low)]
            clauses.append(_expect(above, total, f"at least ppo.batch_size (more than {low})"))
    by_accumulation: dict[int, list[str]] = {}
    for name, ppo in configs.items():
        by_accumulation.setdefault(ppo.gradient_accumulation_steps, []).append(name)
        here = _config(name, default)
        # one of the fields typed, the others from the config file
        divisors = [k for k in ks if ppo.batch_size % k == 0]
        in_config = f"{ppo.batch_size} in {name}"
        clauses.append(
            _expect(
                [here, _empty(batch), _breaks(minis, enum=divisors)],
                minis,
                f"a divisor of ppo.batch_size ({in_config}): {_listed(divisors)}",
            )
        )
        clauses.append(
            _expect(
                [here, _empty(minis), _breaks(batch, multipleOf=ppo.num_mini_batches)],
                batch,
                f"a multiple of ppo.num_mini_batches ({ppo.num_mini_batches} in {name})",
            )
        )
        clauses.append(
            _expect(
                [here, _empty(batch), _breaks(total, minimum=ppo.batch_size)],
                total,
                f"at least ppo.batch_size ({in_config})",
            )
        )
        clauses.append(
            _expect(
                [here, _empty(total), _breaks(batch, maximum=ppo.total_episodes)],
                batch,
                f"at most ppo.total_episodes ({ppo.total_episodes} in {name})",
            )
        )
        accumulation = ppo.gradient_accumulation_steps
        if accumulation > 1:  # the minibatch must split into the config's micro-batches (unless overridden)
            fitting = [k for k in divisors if (ppo.batch_size // k) % accumulation == 0]
            unchanged = [here, NO_ACCUMULATION_OVERRIDE]
            split = f"ppo.gradient_accumulation_steps ({accumulation} in {name})"
            clauses.append(
                _expect(
                    [*unchanged, _empty(batch), _given_in(minis, divisors), _breaks(minis, enum=fitting)],
                    minis,
                    f"a divisor of ppo.batch_size ({in_config}) whose minibatch splits into {split} micro-batches: "
                    + _listed(fitting),
                )
            )
            step = ppo.num_mini_batches * accumulation
            multiple = {"properties": {batch: {"multipleOf": ppo.num_mini_batches}}}
            clauses.append(
                _expect(
                    [*unchanged, _empty(minis), multiple, _breaks(batch, multipleOf=step)],
                    batch,
                    f"a multiple of ppo.num_mini_batches x {split}: {ppo.num_mini_batches} x {accumulation} = {step}",
                )
            )
    for accumulation, names in sorted(by_accumulation.items()):
        if accumulation > 1:  # both fields typed: batch a multiple of minis * the config's accumulation steps
            chosen = {"anyOf": [_config(name, default) for name in names]}
            split = f"ppo.gradient_accumulation_steps ({accumulation} in {', '.join(names)})"
            steps = [
                _expect(
                    [
                        _is(minis, k),
                        {"properties": {batch: {"multipleOf": k}}},
                        _breaks(batch, multipleOf=k * accumulation),
                    ],
                    batch,
                    f"a multiple of ppo.num_mini_batches x {split}: {k} x {accumulation} = {k * accumulation}",
                )
                for k in ks
            ]
            clauses.append(_when([chosen, NO_ACCUMULATION_OVERRIDE], {"allOf": steps}))
    return clauses


def _given_in(name: str, values: list[int]) -> dict[str, Any]:
    return {"properties": {name: {"enum": values}}, "required": [name]}


def group_clauses(configs: Mapping[str, PPOConfig], default: str) -> list[dict[str, Any]]:
    """``allOf`` clauses of the estimator's group rules: ppo.samples_per_prompt divides ppo.batch_size (typed, or the
    chosen config file's), and a group estimator (`GROUP_ESTIMATORS`) has 2 or more samples a prompt (typed, or the
    config file's). Each broken rule shows on one field as what it expects, naming the estimator or batch size."""
    estimator, group, batch = (field_name(k) for k in ("advantage_estimator", "samples_per_prompt", "batch_size"))
    whole = "a batch holds whole groups of samples of a prompt"
    clauses = [
        _expect(
            [_is(group, k), _breaks(batch, multipleOf=k)],
            batch,
            f"a multiple of ppo.samples_per_prompt ({k}): {whole}",
        )
        for k in range(2, MAX_GROUP + 1)
    ]
    for name in GROUP_ESTIMATORS:
        chosen = {"properties": {estimator: {"const": name}}, "required": [estimator]}
        needs = f"2 or more: ppo.advantage_estimator {name} compares the samples of a prompt"
        clauses.append(_expect([chosen, _breaks(group, minimum=2)], group, needs))
        for config, ppo in configs.items():
            if ppo.samples_per_prompt < 2:  # the config's one sample a prompt cannot feed a group estimator
                said = f"{needs} ({config} has {ppo.samples_per_prompt})"
                # the field sent empty shows it; the field left out (the form's int box left empty) has nothing to
                # show it on (JSON Schema would say "'ppo_samples_per_prompt' is a required property"): the
                # estimator's field shows it then
                given = {**_empty(group), "required": [group]}
                clauses.append(_when([_config(config, default), chosen, given], _constrain(group, const=said)))
                absent = {"not": {"required": [group]}}
                clauses.append(_when([_config(config, default), chosen, absent], _constrain(estimator, const=said)))
    for config, ppo in configs.items():
        divisors = [k for k in range(1, MAX_GROUP + 1) if ppo.batch_size % k == 0]
        clauses.append(
            _expect(
                [_config(config, default), _empty(batch), _breaks(group, enum=divisors)],
                group,
                f"a divisor of ppo.batch_size ({ppo.batch_size} in {config}): {_listed(divisors)}; {whole}",
            )
        )
    return clauses
