"""`rlhf bench`: the shapes of docs/benchmark.md, the limit report's arithmetic, a smoke run on a tiny shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import cli
from benchmarks.limit import (
    PhaseRow,
    count_flops,
    format_table,
    format_traffic,
    generation_traffic,
    matmul_peak,
    phase_rows,
    weights_read_per_step,
)
from benchmarks.ppo_bench import SAMPLES_PER_PROMPT, Bench
from benchmarks.shapes import SHAPES, BenchShape, model_classes, model_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmark.md"

# docs/benchmark.md "Shapes": (arch, layers, heads, hidden, vocab, prompts, prompt length, response, minibatches of,
# device, threads)
DOCUMENTED = {
    "cpu": ("gpt2", 4, 4, 128, 1000, 64, 16, 32, 16, "cpu", 2),
    "cpu-long": ("gpt2", 4, 4, 128, 32000, 32, 64, 128, 8, "cpu", 2),
    "cpu-llama": ("llama", 4, 9, 576, 49152, 32, 64, 64, 8, "cpu", 2),
    "gpt2-124m": ("gpt2", 12, 12, 768, 50257, 64, 16, 64, 16, "cuda", 2),
    "llama-1b": ("llama", 22, 32, 2048, 32000, 64, 128, 256, 16, "cuda", 2),
}


def test_shapes_match_the_docs():
    assert list(SHAPES) == list(DOCUMENTED)
    text = DOCS.read_text()
    for name, expected in DOCUMENTED.items():
        s = SHAPES[name]
        got = (s.arch, s.n_layer, s.n_head, s.n_embd, s.vocab_size, s.batch_size, s.prompt_len, s.response_len)
        assert (*got, s.mini_batch_size, s.device, s.threads) == expected, name
        assert (s.num_ppo_epochs, s.num_mini_batches) == (4, 4)
        assert f"| `{name}`" in text
    llama = SHAPES["llama-1b"]
    assert (llama.n_kv_head, llama.intermediate_size, llama.gradient_checkpointing) == (4, 5632, True)
    config = model_config(llama)
    assert (config.num_key_value_heads, config.intermediate_size, config.num_hidden_layers) == (4, 5632, 22)
    assert [c.__name__ for c in model_classes(llama)] == ["LlamaForCausalLM", "LlamaForSequenceClassification"]
    smol = model_config(SHAPES["cpu-llama"])  # SmolLM2-135M's layers
    assert (smol.num_key_value_heads, smol.intermediate_size, smol.head_dim) == (3, 1536, 64)
    assert [c.__name__ for c in model_classes(SHAPES["cpu"])] == ["GPT2LMHeadModel", "GPT2ForSequenceClassification"]


def test_flops_of_a_linear_layer_forward_and_backward():
    layer = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    _, forward = count_flops(layer, x)
    assert forward == 2 * 8 * 64 * 32
    _, weight_grad = count_flops(lambda: layer(x).sum().backward())
    assert weight_grad == 2 * forward  # the backward: the weight's gradient (the input needs none)
    x.requires_grad_()
    _, both = count_flops(lambda: layer(x).sum().backward())
    assert both == 3 * forward  # and the input's


def test_flops_of_cpu_attention_are_counted():
    q = k = v = torch.randn(2, 4, 16, 8)
    _, flops = count_flops(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert flops == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # q @ k^T and scores @ v (the mask is not discounted)


def test_phase_rows_and_percentages():
    rows = phase_rows({"time/generate": 2.0, "time/optimize": 0.5}, {"time/generate": 4_000_000_000})
    assert [r.phase for r in rows] == ["generate", "optimize", "total"]
    assert rows[0].flop_per_s == 2e9 and rows[1].flop_per_s == 0.0
    assert rows[0].percent_of(8e9) == pytest.approx(25.0)
    assert rows[2] == PhaseRow("total", 2.5, 4_000_000_000)
    assert rows[2].percent_of(1.6e9) == pytest.approx(100.0)
    table = format_table(rows, peak_fp32=8e9, peak_bf16=4e9).splitlines()
    assert table[1].split() == ["generate", "2.0000", "4.000", "2.00", "25.0%", "50.0%"]


def test_matmul_peak_is_a_rate():
    rate, n = matmul_peak(torch.float32, torch.device("cpu"), n=512, reps=2)
    assert 1e6 < rate < 1e14 and n == 512


def test_generation_traffic():
    t = generation_traffic(
        weight_params=1000, n_layer=2, n_kv_head=1, head_dim=4, batch=3, prompt_len=5, response_len=3, elem_bytes=2
    )
    # calls 1 and 2 read 6 and 7 positions; each position: 2 (k, v) x 2 layers x 1 head x 4 dims x 2 bytes
    assert t.kv_bytes == 3 * 32 * (6 + 7)
    assert t.total_bytes == 3 * 2000 + t.kv_bytes and t.tokens == 9
    assert t.bytes_per_token == pytest.approx(t.total_bytes / 9)


def test_traffic_line():
    t = generation_traffic(10**6, 2, 2, 64, 4, 8, 4, 2)
    line = format_traffic(t, seconds=t.total_bytes / 1e9, bandwidth=2e9)
    assert "1.0 GB/s achieved, 50.0% of the measured 2 GB/s" in line


def test_weights_read_per_step_skips_gathered_embeddings():
    lm_class, _ = model_classes(SHAPES["cpu"])
    tiny = BenchShape("gpt2", 1, 2, 16, 50, batch_size=4, prompt_len=4, response_len=4)
    model = lm_class(model_config(tiny))  # the token embedding is the (tied) LM head: read in full
    total = sum(p.numel() for p in model.parameters())
    assert weights_read_per_step(model) == total - model.transformer.wpe.weight.numel()


TINY = BenchShape("gpt2", 2, 2, 32, 64, batch_size=8, prompt_len=4, response_len=6, num_mini_batches=2)
TINY_LLAMA = BenchShape(
    "llama", 2, 4, 32, 64, batch_size=8, prompt_len=4, response_len=6, num_mini_batches=2, n_kv_head=2,
    intermediate_size=64, gradient_checkpointing=True,
)  # fmt: skip


@pytest.mark.parametrize("tiny", [TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_smoke_on_a_tiny_shape(monkeypatch, capsys, tiny):
    monkeypatch.setitem(SHAPES, "tiny", tiny)
    monkeypatch.setattr(cli, "matmul_peak", lambda dtype, device: (1e10, 2048))
    assert cli.main(["--shape", "tiny", "--updates", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("episodes/s: ") and float(out[-1].split(": ")[1]) > 0
    assert sum(line.startswith("update ") for line in out) == 2
    table = {line.split()[0]: line.split() for line in out if line.startswith("  ") and "%" in line}
    assert set(table) == {"phase", "generate", "score", "advantages", "optimize", "total"}
    assert float(table["optimize"][2]) > 0 and float(table["score"][2]) > 0 and float(table["generate"][2]) > 0


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp"])
def test_a_critic_free_estimator_benches_without_a_value_model(monkeypatch, capsys, estimator):
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    bench = Bench(TINY, torch.device("cpu"), torch.float32, 2, estimator=estimator)
    assert bench.models.value is None and bench.cfg.samples_per_prompt == SAMPLES_PER_PROMPT
    query, _ = bench.query()  # 8 episodes: 2 prompts of 4 samples each, in a row
    assert torch.equal(query[:4], query[0].expand(4, -1)) and not torch.equal(query[0], query[4])
    args = ["--shape", "tiny", "--updates", "2", "--device", "cpu", "--no-limit", "--estimator", estimator]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"estimator={estimator}" in out[0] and float(out[-1].split(": ")[1]) > 0


def test_llama_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--shape", "llama-1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "The llama-1b shape runs on a CUDA GPU (bf16) and this machine has no CUDA device."


@pytest.mark.slow
def test_the_gpu_check_dry_run_writes_its_table(tmp_path):
    """`make gpu-check`'s command on the CPU shapes (--dry-run): every row runs or says why not, and the table is
    written as markdown and JSON."""
    import json

    from benchmarks import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in table["rows"]}
    assert {"card", "gpt2-124m gae", "gpt2-124m grpo", "llama-1b gae", "first update bf16, LoRA"} <= set(rows)
    assert all(row["status"] in ("ok", "skipped") for row in rows.values())
    assert rows["gpt2-124m gae"]["figures"]["episodes/s"] > 0
    for mode in ("LoRA", "full fine-tuning"):  # the pipeline's references: KL exactly 0, ratio exactly 1 in bf16
        figures = rows[f"first update bf16, {mode}"]["figures"]
        assert figures["KL max |.|"] == 0 and figures["ratio mean (minibatch 1)"] == 1
    note = rows["first update bf16, LoRA"]["note"]  # a dry run: random weights; without the GGUF it says why
    assert "random init" in note and (gpu_check.REAL_GGUF.is_file() or "94 MiB" in note), note
    assert rows["pipeline"]["status"] == "skipped" and rows["pipeline"]["note"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| gpt2-124m grpo | ok |" in markdown and "not installed:" in markdown


def test_the_gpu_check_refuses_without_cuda_and_says_so(monkeypatch, tmp_path, capsys):
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


def test_a_gpu_check_row_past_the_budget_is_skipped_with_the_reason(tmp_path):
    from benchmarks import gpu_check

    plan = gpu_check.make_plan(dry_run=True)
    rows = gpu_check.run_checks(plan, budget_s=1, only={"card", "llama-1b gae"})
    assert rows[-1].status == "skipped" and "of the budget left" in rows[-1].note


def test_the_bench_times_what_make_run_runs(monkeypatch, capsys):
    """--dtype auto is the pipeline's runtime.dtype auto on this machine (its CPU's bf16 check at the shape's width),
    named with its reason in the header and on every update's line."""
    from rlhf.models.device import compute_dtype, dtype_reason

    monkeypatch.setitem(SHAPES, "tiny", TINY)
    cpu = torch.device("cpu")
    here = str(compute_dtype("auto", cpu, width=TINY.n_embd)).removeprefix("torch.")
    assert cli.main(["--shape", "tiny", "--updates", "2", "--device", "cpu", "--no-limit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"dtype={here}" in out[0]
    assert out[1] == f"dtype {here}: " + dtype_reason("auto", cpu, width=TINY.n_embd).replace(
        "runtime.dtype", "--dtype", 1
    )
    updates = [line for line in out if line.startswith("update ")]
    assert len(updates) == 2 and all(line.startswith(f"update {i}/2 ({here}): ") for i, line in enumerate(updates, 1))
    assert out[-2].startswith(f"this project ({here}) episodes/s: ") and out[-1].startswith("episodes/s: ")
    assert cli.main(["--shape", "tiny", "--updates", "2", "--device", "cpu", "--no-limit", "--dtype", "float32"]) == 0
    assert "update 1/2 (float32): " in capsys.readouterr().out


FAKE_PEER = """import sys
bf16 = "--bf16" in sys.argv
dtype = "bfloat16" if bf16 else "float32"
print(f"peer: a stand-in for TRL, {' '.join(sys.argv[1:])}")
print(f"update 1/1 ({dtype}): 9.00 episodes/s")
print(f"episodes/s: {2.0 if bf16 else 1.0}")
"""


def test_each_peer_runs_in_each_dtype_the_cpu_has_and_the_ratio_is_to_the_faster(monkeypatch, capsys, tmp_path):
    """The peers' dtype plumbing (BENCH.md: each peer in its fastest dtype on the machine at hand): float32 and TRL's
    bf16 on a CPU with native bf16, float32 alone on others, bf16 on a GPU; every line names the peer's dtype and
    the ratio is to the faster. A stand-in script in place of benchmarks/trl_peer.py (the peers' venvs hold TRL)."""
    from rlhf.models.cpu_bf16 import cpu_has_native_bf16

    assert cli.peer_dtypes(torch.device("cuda")) == ("bfloat16",)
    dtypes = cli.peer_dtypes(torch.device("cpu"))
    assert dtypes == (("float32", "bfloat16") if cpu_has_native_bf16() else ("float32",))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = tmp_path / "peer.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(cli, "PEER_SCRIPT", script)
    monkeypatch.setitem(cli.ESTIMATOR_PEERS, "gae", ((("stand-in", str(venv)),), "ppo"))
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    assert cli.main(["--shape", "tiny", "--updates", "2", "--device", "cpu", "--no-limit", "--peers"]) == 0
    out = capsys.readouterr().out.splitlines()
    for dtype in dtypes:
        assert f"[stand-in, {dtype}] update 1/1 ({dtype}): 9.00 episodes/s" in out
        assert (tmp_path / ("venv.log" if dtype == "float32" else f"venv.{dtype}.log")).is_file()
        figure = "2.00" if dtype == "bfloat16" else "1.00"
        assert any(line.startswith(f"peer stand-in ({dtype}) episodes/s: {figure}; this project (") for line in out)
    best = dtypes[-1]  # the stand-in is faster in bf16
    (ratio,) = [line for line in out if line.startswith("ratio to the best peer")]
    assert ratio.startswith(f"ratio to the best peer (stand-in, {best}: its fastest dtype here) of this project (")
    missing = cli.run_peer("gone", str(tmp_path / "no-venv"), "tiny", 2, None, "ppo", "bfloat16")
    assert missing is None and "[gone, bfloat16] no " in capsys.readouterr().out
