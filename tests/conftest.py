"""Shared fixtures: an isolated Prefect home, no telemetry, and tiny but real transformers models."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before prefect is imported anywhere: a private home (results, DB) and no network.
_HOME = tempfile.mkdtemp(prefix="rlhf-tests-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import pytest  # noqa: E402
import torch  # noqa: E402

from rlhf.data import synthetic  # noqa: E402
from rlhf.models.bootstrap import build_tiny_gpt2, build_tokenizer  # noqa: E402
from rlhf.models.loading import load_reward_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """A tiny GPT-2 policy and a scalar-head model from it, saved and loadable with the Auto classes."""
    root = tmp_path_factory.mktemp("tiny")
    texts = [d.prompt + d.response for d in synthetic.demonstrations(200, seed=0)]
    tok = build_tokenizer(texts, vocab_size=300)
    policy = build_tiny_gpt2(tok, n_layer=1, n_head=2, n_embd=32, n_positions=256, seed=0)
    policy.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    reward = load_reward_model(str(root / "policy"), torch.device("cpu"))
    torch.nn.init.normal_(reward.score.weight, std=0.5)  # a non-trivial head, so scores differ
    reward.save_pretrained(root / "reward")
    tok.save_pretrained(root / "reward")
    return {"policy": str(root / "policy"), "reward": str(root / "reward")}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family -> the folder of a tiny random checkpoint of that model family (tests/model_zoo.py), built once."""
    from tests.model_zoo import build_family

    root = tmp_path_factory.mktemp("zoo")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family(family, root / family)
        return built[family]

    return get


# -- Reading a flow run back from the Prefect API (the test harness's server) ------------------------------------


def _query(fetch):
    """Run `fetch(client)` against the Prefect API and return its result."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def run():
        async with get_client() as client:
            return await fetch(client)

    return asyncio.run(run())


def stage_name(task_run) -> str:
    """A task run's name without Prefect's suffix: 'train_policy_ppo-3f2' -> 'train_policy_ppo'."""
    return task_run.name.rsplit("-", 1)[0]


def task_runs(flow_run_id) -> list:
    """The task runs of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return _query(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))))


def task_states(flow_run_id) -> dict[str, str]:
    """{task name: state name} of a flow run."""
    return {stage_name(t): t.state.name for t in task_runs(flow_run_id)}


def subflow_runs(parent_flow_run_id) -> list:
    """The flow runs started as subflows of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    parent = FlowRunFilterParentFlowRunId(any_=[parent_flow_run_id])
    return _query(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=parent)))


def flow_run_artifacts(flow_run_id) -> list:
    """The artifacts of a flow run, newest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    by_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    return _query(lambda c: c.read_artifacts(artifact_filter=by_run, sort=ArtifactSort.CREATED_DESC))
