"""`runtime.dtype: auto` on a CPU (rlhf/models/cpu_bf16.py): bf16 autocast where the CPU multiplies bf16 natively and
the measured check passes, float32 where its flags lack AVX-512 BF16 and AMX or the check fails; a named dtype always
wins. The check runs for real here (timings and numerics of this CPU); its result is passed in as an argument where a
test needs the other outcome than this machine's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf.models import cpu_bf16
from rlhf.models.cpu_bf16 import (
    MAX_ERROR,
    MIN_SPEEDUP,
    NARROWEST_BF16,
    CpuBf16Check,
    check_cpu_bf16,
    cpu_bf16_check,
    machine_key,
)
from rlhf.models.device import compute_dtype, dtype_reason, resolved_dtype_name

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
PASSES = CpuBf16Check(native=True, speedup=2.0, error=3e-3)


def test_no_native_bf16_flags_is_float32_without_measuring():
    check = check_cpu_bf16(frozenset({"avx2", "fma", "avx512f"}))  # AVX-512 without its bf16 dot products
    assert check == CpuBf16Check(native=False) and not check.passed
    assert compute_dtype("auto", CPU, check) == torch.float32
    assert "no native bf16" in dtype_reason("auto", CPU, check)


def test_a_failed_check_is_float32():
    too_slow = CpuBf16Check(native=True, speedup=MIN_SPEEDUP * 0.9, error=3e-3)
    too_coarse = CpuBf16Check(native=True, speedup=3.0, error=MAX_ERROR * 5)
    not_finite = CpuBf16Check(native=True, speedup=3.0, error=float("inf"))
    for check in (too_slow, too_coarse, not_finite):
        assert not check.passed
        assert compute_dtype("auto", CPU, check) == torch.float32
        assert "but bf16 autocast measured" in dtype_reason("auto", CPU, check)


def test_a_passed_check_is_bf16():
    assert PASSES.passed
    assert compute_dtype("auto", CPU, PASSES) == torch.bfloat16
    assert "native bf16, bf16 autocast measured 2.00x float32" in dtype_reason("auto", CPU, PASSES)


def test_a_named_dtype_always_wins():
    for check in (PASSES, CpuBf16Check(native=False), CpuBf16Check(native=True, speedup=0.5, error=3e-3)):
        assert compute_dtype("float32", CPU, check) == torch.float32
        assert compute_dtype("bfloat16", CPU, check) == torch.bfloat16
        assert compute_dtype("float16", CPU, check) == torch.float16
        assert dtype_reason("float32", CPU, check) == "runtime.dtype: float32"


def test_the_measured_check_on_this_cpu():
    """The real check, with native flags claimed (the numerics hold wherever bf16 autocast accumulates in float32, as
    torch's CPU kernels do, emulated or not); on a CPU with native bf16 its verdict is this machine's `auto`."""
    check = check_cpu_bf16(frozenset({"avx512_bf16"}))
    assert check.native and check.speedup > 0 and 0 < check.error <= MAX_ERROR
    assert check.passed == (check.speedup >= MIN_SPEEDUP)
    here = cpu_bf16.cpu_has_native_bf16()
    assert resolved_dtype_name("auto", "cpu") in (("float32", "bfloat16") if here else ("float32",))


def test_the_verdict_is_measured_once_and_kept(tmp_path):
    path = tmp_path / "cache" / "cpu_bf16.json"
    first = cpu_bf16_check(path)
    entries = json.loads(path.read_text())
    assert entries[machine_key()]["native"] == first.native == cpu_bf16.cpu_has_native_bf16()
    assert "torch " + torch.__version__ in machine_key()
    # a verdict kept in the file is used as it is, not measured again (this one could not be measured here)
    kept = {"native": True, "speedup": 0.25, "error": 0.5, "measured": "earlier"}
    path.write_text(json.dumps({**entries, machine_key(): kept, "another CPU | torch 0": kept}))
    cpu_bf16._VERDICTS.clear()
    assert cpu_bf16_check(path) == CpuBf16Check(True, 0.25, 0.5)
    assert cpu_bf16_check(path) is cpu_bf16_check(path)  # then from this process's memory
    path.write_text(json.dumps({"another CPU | torch 0": kept}))  # this machine not in it: measured and added
    cpu_bf16._VERDICTS.clear()
    cpu_bf16_check(path)
    assert set(json.loads(path.read_text())) == {"another CPU | torch 0", machine_key()}
    # a damaged file is measured again and rewritten; the other machines' entries of a readable one are kept
    path.write_text("{not json")
    cpu_bf16._VERDICTS.clear()
    assert cpu_bf16_check(path).native == first.native
    assert machine_key() in json.loads(path.read_text())
    cpu_bf16._VERDICTS.clear()


def test_a_cache_that_cannot_be_written_still_decides(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    verdict = cpu_bf16_check(blocked / "cpu_bf16.json")  # its folder is a file: nothing written, no error
    assert verdict.native == cpu_bf16.cpu_has_native_bf16()
    assert not (blocked / "cpu_bf16.json").exists()


def test_a_model_narrower_than_128_is_float32():
    """Where bf16 pays on the CPU, `auto` still computes a narrow model in float32 (a whole update ran slower there);
    an unknown width (a hub id) is taken as wide."""
    assert compute_dtype("auto", CPU, PASSES, width=NARROWEST_BF16 - 1) == torch.float32
    assert "the model's width 127 is under 128" in dtype_reason("auto", CPU, PASSES, width=127)
    for width in (NARROWEST_BF16, 576, None):
        assert compute_dtype("auto", CPU, PASSES, width=width) == torch.bfloat16
        assert "bf16 autocast measured 2.00x" in dtype_reason("auto", CPU, PASSES, width=width)
    assert compute_dtype("bfloat16", CPU, PASSES, width=32) == torch.bfloat16  # a named dtype still wins


def test_the_config_tells_the_runtime_its_models_width(tmp_path):
    """`runtime.model_width` (what `auto` is checked at) comes from the rest of the config on every validation: the
    embedded model's n_embd, a local checkpoint's config.json, unknown for a hub id; a sweep variant that changes the
    model gets its own; the PPO stage's torchrun file carries it."""
    from rlhf.config import load_config
    from rlhf.ppo.run import PolicyInputs
    from rlhf.sweeps.space import expand, parse_space, variant_config

    base = load_config(REPO / "conf" / "smoke.yaml", [])
    assert base.runtime.model_width == base.sft.bootstrap.n_embd == 64
    assert "model_width" not in base.runtime.model_dump()  # not a key: nothing a user sets or a run logs
    space = parse_space({"name": "w", "method": "grid", "parameters": {"sft.bootstrap.n_embd": [128]}})
    assert variant_config(base, space, expand(space)[0]).runtime.model_width == 128
    assert base.runtime.model_width == 64
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 48}))
    assert load_config(REPO / "conf" / "smoke.yaml", [f"sft.model={checkpoint}"]).runtime.model_width == 48
    assert load_config(REPO / "conf" / "smoke.yaml", ["sft.model=org/hub-model"]).runtime.model_width is None
    inputs = PolicyInputs(base.ppo, base.runtime, 0, "p", "r", prompts_file="x.parquet", out_dir=str(tmp_path))
    inputs.write(tmp_path / "inputs.yaml")
    assert PolicyInputs.read(tmp_path / "inputs.yaml").runtime.model_width == 64


def test_the_cache_key_takes_autos_choice_at_the_models_width(monkeypatch):
    """Two runs in `auto` on one machine share a stage's key only where `auto` chose one dtype for both widths."""
    from rlhf.config import RuntimeConfig
    from tasks.caching import runtime_key

    monkeypatch.setattr(cpu_bf16, "_VERDICTS", {cpu_bf16.cache_file(): PASSES})

    def key(width):
        return runtime_key("train_reward_model", RuntimeConfig(device="cpu").with_model_width(width))

    assert key(64)["dtype"] == "float32" and key(None)["dtype"] == key(128)["dtype"] == "bfloat16"
