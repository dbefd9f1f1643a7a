"""GGUF checkpoints: a tiny Llama written to a GGUF file (F32 tensors, llama.cpp's names and q/k permutation) loads
through the project's path as its source model, dequantised once into a content-addressed folder that later calls
reuse; bad files are one sentence naming the file, before any model loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf.config import RuntimeConfig, SFTConfig, load_config
from rlhf.errors import ConfigError
from rlhf.models import gguf as gguf_models
from rlhf.models.gguf import CACHE_FOLDER, GGUFFile, resolve_model
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tests.model_zoo import build_smollm_like, write_gguf

pytest.importorskip("gguf")
CPU = torch.device("cpu")
CHAT = [
    {"role": "user", "content": "the plot was good"},
    {"role": "assistant", "content": "the cast was great"},
    {"role": "user", "content": "and the music?"},
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny SmolLM2-like Llama (tied embeddings), its tokenizer, and the GGUF file written from them."""
    model, tokenizer = build_smollm_like()
    folder = tmp_path_factory.mktemp("gguf")
    return model, tokenizer, write_gguf(model, tokenizer, folder / "tiny-smollm.gguf")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_a_gguf_file_loads_as_the_model_it_was_written_from(source, tmp_path):
    model, tokenizer, path = source
    loaded = resolve_model("sft.model", str(path), None, None, tmp_path)
    folder = Path(loaded.path)
    assert folder.parent == tmp_path.resolve() / CACHE_FOLDER
    assert folder.name == f"tiny-smollm-{gguf_models.gguf_digest(path)[:16]}"  # content-addressed
    assert loaded.revision is None and loaded.digest
    dense = load_causal_lm(str(folder), CPU)
    assert next(dense.parameters()).dtype == torch.float32
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    # F32 tensors: the same weights (q/k permuted and back), so the same logits up to float noise
    torch.testing.assert_close(_logits(dense, ids), _logits(model, ids), rtol=0, atol=1e-5)
    # the tokenizer comes with it: the same ids, chat template and special tokens
    tok = load_tokenizer(str(folder))
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == text
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    # the data tokenizer read straight from the file (data.tokenizer defaults to sft.model) is the same tokenizer
    assert load_tokenizer(str(path))(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_the_dequantised_folder_is_reused_and_a_half_written_one_never_is(source, tmp_path, monkeypatch):
    _, _, path = source
    first = resolve_model("sft.model", str(path), None, None, tmp_path)
    folder = Path(first.path)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_models, "_write_dense", no_second_conversion)
        again = resolve_model("sft.model", str(path), None, None, tmp_path)
    assert again == first and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # a folder cut short (a file its manifest lists is gone) is written again, never used
    (folder / "model.safetensors").unlink()
    third = resolve_model("sft.model", str(path), None, None, tmp_path)
    assert third == first and (folder / "model.safetensors").is_file()

    # a conversion that dies leaves no folder behind that a later run could take for a finished one
    def dies_midway(key: str, src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    fresh = tmp_path / "fresh"
    with monkeypatch.context() as patch:
        patch.setattr(gguf_models, "_write_dense", dies_midway)
        with pytest.raises(KeyboardInterrupt):
            resolve_model("sft.model", str(path), None, None, fresh)
    assert not [p for p in (fresh / CACHE_FOLDER).iterdir() if p.is_dir()]


def test_sft_model_names_a_gguf_file_or_a_folder_and_gguf_file(source, tmp_path):
    from rlhf.models.model_config import read_model_config
    from rlhf.preflight import preflight
    from rlhf.train.sft import load_existing

    model, _, path = source
    for overrides in ([f"sft.model={path}"], [f"sft.model={path.parent}", f"sft.gguf_file={path.name}"]):
        config = load_config(None, [*overrides, f"runtime.output_dir={tmp_path}", "runtime.memory_check=off"])
        assert (config.data.tokenizer, config.data.tokenizer_gguf_file) == (config.sft.model, config.sft.gguf_file)
        preflight(config)  # reads the metadata only: no folder written yet
        assert not (tmp_path / CACHE_FOLDER).exists()
        shape = read_model_config(config.sft)
        assert (shape.model_type, shape.num_hidden_layers, shape.hidden_size) == ("llama", 2, 32)
    # the config preflight builds from the header is the one transformers builds from the whole file
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    assert {**shape.to_dict(), "_name_or_path": ""} == {**full, "_name_or_path": ""}
    result = load_existing(SFTConfig(model=str(path)), RuntimeConfig(output_dir=str(tmp_path)))
    assert Path(result.path).parent == tmp_path.resolve() / CACHE_FOLDER and not result.trained
    with pytest.raises(ConfigError, match="sft.gguf_file needs sft.model"):
        load_config(None, ["sft.gguf_file=x.gguf"])
    with pytest.raises(ConfigError, match="is a GGUF file already"):
        load_config(None, [f"sft.model={path}", "sft.gguf_file=x.gguf"])


def _one_sentence(err: pytest.ExceptionInfo, *names: str) -> str:
    text = str(err.value)
    assert "\n" not in text and all(name in text for name in names), text
    return text


def test_bad_gguf_files_are_one_sentence_naming_the_file(source, tmp_path, monkeypatch):
    from rlhf.preflight import preflight

    model, tokenizer, path = source

    def check(file: Path, *words: str) -> str:
        with pytest.raises(ConfigError) as err:
            preflight(load_config(None, [f"sft.model={file}", "runtime.memory_check=off"]))
        return _one_sentence(err, str(file), *words)

    check(tmp_path / "missing.gguf", "does not exist")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])  # a download cut short
    check(cut, "not a readable GGUF file")
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf file at all" * 10)
    check(foreign, "not a readable GGUF file")
    rwkv = write_gguf(model, tokenizer, tmp_path / "rwkv.gguf", architecture="rwkv7")
    assert "'rwkv7'" in check(rwkv, "cannot load from GGUF", "llama")
    # the package missing: which extra to install
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert 'pip install -e ".[gguf]"' in check(path, "gguf package")
    # a folder plus a file name it does not hold
    with pytest.raises(ConfigError) as err:
        gguf_models.gguf_path("sft.gguf_file", GGUFFile(str(tmp_path), "nope.gguf", True))
    _one_sentence(err, "sft.gguf_file", "nope.gguf", "does not exist")


def test_a_bad_gguf_file_stops_the_command_with_exit_code_2(tmp_path, capsys):
    from flows.pipeline_command import main

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["--config", "conf/smoke.yaml", f"sft.model={cut}", f"runtime.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: sft.model: {cut}") and "Traceback" not in err[0]
