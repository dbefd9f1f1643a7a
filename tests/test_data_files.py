"""Files as users have them: compressed data files and Git LFS pointers (a clone without git-lfs)."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import lzma

import pandas as pd
import pytest

from rlhf.config import DataConfig, load_config
from rlhf.data.files import file_kind
from rlhf.data.prepare import prepare_preferences
from rlhf.data.source_checks import check_source
from rlhf.data.sources import peek_columns, read_table
from rlhf.errors import DataError

POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 13215402\n"
)


def hh_rows(n: int, start: int = 0) -> list[dict]:
    """Anthropic HH-RLHF layout: chosen/rejected full transcripts that differ in the last assistant turn."""
    rows = []
    for i in range(start, start + n):
        history = f"\n\nHuman: hi {i}\n\nAssistant: hello\n\nHuman: what is {i} + 1?\n\nAssistant:"
        rows.append({"chosen": history + f" It is {i + 1}.", "rejected": history + " No idea."})
    return rows


def jsonl(rows: list[dict]) -> bytes:
    return "\n".join(json.dumps(r) for r in rows).encode()


@pytest.mark.parametrize(
    "name, pack",
    [
        ("train.jsonl.gz", lambda rows: gzip.compress(jsonl(rows))),
        ("train.jsonl.bz2", lambda rows: bz2.compress(jsonl(rows))),
        ("train.jsonl.xz", lambda rows: lzma.compress(jsonl(rows))),
        ("train.json.gz", lambda rows: gzip.compress(json.dumps(rows).encode())),
    ],
)
def test_compressed_hh_file_is_read_as_data_path(tmp_path, name, pack):
    path = tmp_path / name
    path.write_bytes(pack(hh_rows(20)))
    cfg = DataConfig(source="local", path=str(path), eval_fraction=0.25)
    check_source(cfg)
    out = prepare_preferences(cfg, tmp_path / "out")
    assert out.manifest["format"] == "implicit" and out.manifest["rows"]["train"] + out.manifest["rows"]["eval"] == 20
    train = pd.read_parquet(out.train)
    assert train["prompt"].str.endswith("\n\nAssistant:").all() and train["chosen"].str.startswith(" It is").all()


def test_compressed_csv_eval_and_prompt_files(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(12)]
    train, held, prompts = tmp_path / "train.csv.gz", tmp_path / "test.jsonl.gz", tmp_path / "prompts.csv.gz"
    pd.DataFrame(rows).to_csv(train, index=False)  # pandas compresses from the name
    held.write_bytes(gzip.compress(jsonl([{"prompt": "e1", "chosen": "a", "rejected": "b"}])))
    pd.DataFrame({"text": ["p1", "p2"]}).to_csv(prompts, index=False)
    cfg = DataConfig(
        source="local", path=str(train), eval_path=str(held), prompts_path=str(prompts), prompts_column="text"
    )
    check_source(cfg)
    out = prepare_preferences(cfg, tmp_path / "out")
    assert out.manifest["rows"]["train"] == 12 and out.manifest["rows"]["eval"] == 1
    assert pd.read_parquet(out.prompts)["prompt"].tolist() == ["p1", "p2"]
    # the cheap column check looks inside the compressed files too
    assert peek_columns(train) == peek_columns(held) == ["prompt", "chosen", "rejected"]
    with pytest.raises(DataError, match=r"data.columns.prompt: column 'question' is not in .*train.csv.gz"):
        check_source(cfg.model_copy(update={"columns": {"prompt": "question"}}))
    assert read_table(held)["prompt"].tolist() == ["e1"]


def test_extensions_and_compressions():
    assert file_kind("a/train.jsonl.gz") == (".jsonl", "json", "gzip")
    assert file_kind("x.CSV.BZ2") == (".csv", "csv", "bz2")
    assert file_kind("x.v2.parquet") == (".parquet", "parquet", None)
    with pytest.raises(DataError, match=r"data.path: x.txt.gz has an unsupported extension '.txt.gz' \(use .jsonl"):
        file_kind("x.txt.gz")
    with pytest.raises(DataError, match=r"unsupported extension '.parquet.gz'"):
        file_kind("x.parquet.gz")  # Parquet is compressed inside
    if importlib.util.find_spec("zstandard") is None:
        with pytest.raises(DataError, match=r"x.jsonl.zst is zstd-compressed and reading it needs the 'zstandard'"):
            file_kind("x.jsonl.zst")
    else:
        assert file_kind("x.jsonl.zst") == (".jsonl", "json", "zstd")


def test_git_lfs_pointer_is_refused_with_one_sentence(tmp_path):
    pointer = tmp_path / "train.jsonl.gz"
    pointer.write_text(POINTER)
    real = tmp_path / "real.jsonl"
    real.write_bytes(jsonl(hh_rows(10)))
    sentence = r"is a Git LFS pointer, not the data: the repository was cloned without git-lfs; run `git lfs pull`"
    cases = [
        ("data.path", DataConfig(source="local", path=str(pointer))),
        ("data.eval_path", DataConfig(source="local", path=str(real), eval_path=str(pointer))),
        ("data.prompts_path", DataConfig(source="local", path=str(real), prompts_path=str(pointer))),
        ("data.prompts_path", DataConfig(source="hub", name="org/x", prompts_path=str(pointer))),
    ]
    for key, cfg in cases:
        with pytest.raises(DataError, match=rf"^{key}: .*train.jsonl.gz {sentence} in it$"):
            check_source(cfg)
        if cfg.source == "local":
            with pytest.raises(DataError, match=rf"^{key}: .*train.jsonl.gz {sentence}"):
                prepare_preferences(cfg, tmp_path / "out")
    with pytest.raises(DataError, match=sentence):
        read_table(pointer)


def test_git_lfs_pointer_inside_a_data_folder(tmp_path):
    """A clone of Anthropic/hh-rlhf without git-lfs: its subsets' files are pointers."""
    for subset in ("helpful-base", "harmless-base"):
        (tmp_path / "hh" / subset).mkdir(parents=True)
        for split in ("train", "test"):
            (tmp_path / "hh" / subset / f"{split}.jsonl.gz").write_text(POINTER)
    (tmp_path / "hh" / ".git").mkdir()
    (tmp_path / "hh" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # not data: not looked at
    cfg = DataConfig(source="local", path=str(tmp_path / "hh"), eval_split="test")
    first = r"^data.path: .*harmless-base/test.jsonl.gz \(and 3 more file\(s\) under .*hh\) is a Git LFS pointer"
    with pytest.raises(DataError, match=first):
        check_source(cfg)
    # `git lfs pull --include "helpful-base/*"` fetched one subset: that subset reads, the others are not looked at
    for split, n, start in (("train", 12, 0), ("test", 4, 100)):
        (tmp_path / "hh" / "helpful-base" / f"{split}.jsonl.gz").write_bytes(gzip.compress(jsonl(hh_rows(n, start))))
    subset = cfg.model_copy(update={"data_dir": "helpful-base"})
    check_source(subset)
    out = prepare_preferences(subset, tmp_path / "out")
    assert out.manifest["rows"]["train"] == 12 and out.manifest["rows"]["eval"] == 4
    with pytest.raises(DataError, match=r"^data.path: .*harmless-base/test.jsonl.gz \(and 1 more"):
        prepare_preferences(cfg.model_copy(update={"data_dir": "harmless-base"}), tmp_path / "out2")


def test_preflight_refuses_a_git_lfs_pointer(tmp_path):
    from rlhf.preflight import preflight

    pointer = tmp_path / "train.jsonl"
    pointer.write_text(POINTER)
    config = load_config(None, ["data.source=local", f"data.path={pointer}"])
    with pytest.raises(DataError, match=r"^data.path: .*train.jsonl is a Git LFS pointer"):
        preflight(config)


# -- Bytes, lines and numbers: the file read through before it is loaded (rlhf/data/scan.py) ----------------------


def explicit_rows(n: int) -> list[dict]:
    return [{"prompt": f"Critique {i}:", "chosen": f" très bien {i}.", "rejected": f" mauvais {i}."} for i in range(n)]


def test_a_latin_1_file_names_the_byte_and_line_and_loads_with_data_encoding(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in explicit_rows(20)]
    path.write_bytes("\n".join(lines).encode("latin-1"))
    first = lines[0].encode("utf-8").index("è".encode())  # its offset: the same in Latin-1 before the first 'è'
    cfg = DataConfig(source="local", path=str(path))
    with pytest.raises(DataError) as err:
        check_source(cfg)
    assert str(err.value) == (
        f"data.path: {path} is not UTF-8 text: byte 0xe8 at byte offset {first} (line 1) cannot be decoded; "
        "re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or set data.encoding to its encoding (e.g. "
        "latin-1, cp1252)"
    )
    from rlhf.data.sources import open_local

    with pytest.raises(DataError, match=r"is not UTF-8 text: byte 0xe8"):  # also where preflight does not read it
        open_local(str(path), "train", str(tmp_path / "cache"))
    latin = cfg.model_copy(update={"encoding": "latin-1"})
    written = prepare_preferences(latin, tmp_path / "out")
    assert " très bien 0." in set(pd.read_parquet(written.train)["chosen"]) | set(
        pd.read_parquet(written.eval)["chosen"]
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_utf_8_file_with_a_byte_order_mark_is_read(tmp_path, suffix):
    path = tmp_path / f"pairs{suffix}"
    frame = pd.DataFrame(explicit_rows(20))
    text = frame.to_csv(index=False) if suffix == ".csv" else frame.to_json(orient="records", lines=True)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    cfg = DataConfig(source="local", path=str(path))
    check_source(cfg)
    assert peek_columns(path) == ["prompt", "chosen", "rejected"]
    assert prepare_preferences(cfg, tmp_path / "out").manifest["rows_in"] == 20


def test_a_utf_16_file_says_so_and_loads_with_data_encoding(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes("\n".join(json.dumps(r) for r in explicit_rows(20)).encode("utf-16"))
    cfg = DataConfig(source="local", path=str(path))
    with pytest.raises(DataError, match=r"is UTF-16 text \(it starts with a UTF-16 byte-order mark\)"):
        check_source(cfg)
    cfg = cfg.model_copy(update={"encoding": "utf-16"})
    check_source(cfg)
    assert prepare_preferences(cfg, tmp_path / "out").manifest["rows_in"] == 20


@pytest.mark.parametrize(
    "pack", [lambda b: b, gzip.compress, bz2.compress, lzma.compress], ids=["plain", "gz", "bz2", "xz"]
)
def test_a_malformed_line_is_named_by_its_number(tmp_path, pack):
    suffix = {b"\x1f\x8b": ".gz", b"BZ": ".bz2", b"\xfd7": ".xz"}.get(pack(b"x")[:2], "")
    path = tmp_path / f"pairs.jsonl{suffix}"
    lines = [json.dumps(r) for r in explicit_rows(30)]
    lines[21] = lines[21].replace('"chosen":', '"chosen"')
    path.write_bytes(pack("\n".join(lines).encode()))
    with pytest.raises(DataError, match=rf"data.path: line 22 of {path} is not valid JSON \(Expecting ':' delimiter"):
        check_source(DataConfig(source="local", path=str(path)))
    # a file past preflight's size limit: datasets cannot load it, and the same read names the line
    from rlhf.data.sources import open_local

    with pytest.raises(DataError, match=rf"data.path: line 22 of {path} is not valid JSON"):
        open_local(str(path), "train", str(tmp_path / "cache"))


def test_a_download_cut_short_is_named(tmp_path):
    path = tmp_path / "pairs.jsonl.gz"
    data = gzip.compress("\n".join(json.dumps(r) for r in explicit_rows(2000)).encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"could not be read to its end as a gzip-compressed file .* download it again"):
        check_source(DataConfig(source="local", path=str(path)))


def test_non_finite_scores_and_margins_are_counted_and_refused_past_max_drop_fraction(tmp_path):
    rows = explicit_rows(20)
    margins = [dict(r, margin=float("nan") if i < 5 else 1.0) for i, r in enumerate(rows)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in margins))  # Python's json writes NaN, as many exporters do
    written = prepare_preferences(DataConfig(source="local", path=str(path)), tmp_path / "a")
    assert written.manifest["dropped"]["not_finite"] == 5 and written.manifest["rows_in"] == 20
    kept = pd.concat([pd.read_parquet(written.train), pd.read_parquet(written.eval)])
    assert kept["margin"].notna().all() and len(kept) == 15
    cfg = DataConfig(source="local", path=str(path), max_drop_fraction=0.2)
    with pytest.raises(DataError) as err:
        check_source(cfg)  # before anything is loaded: 5 of 20 rows already pass the limit
    assert "data.path: 5 of 20 rows" in str(err.value) and "(the first: " in str(err.value)
    assert f"{path} line 1 (column 'margin')" in str(err.value) and "data.max_drop_fraction (0.2)" in str(err.value)


def test_scores_are_what_counts_when_a_row_has_both_scores_and_a_margin(tmp_path):
    """The margin of a row with both scores is their difference (its margin column is not read): a NaN there is no
    reason to drop the row, and preflight does not count it."""
    rows = [dict(r, score_chosen=2.0, score_rejected=1.0, margin=float("nan")) for r in explicit_rows(20)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="local", path=str(path), max_drop_fraction=0.0)
    check_source(cfg)
    written = prepare_preferences(cfg, tmp_path / "out")
    assert written.manifest["dropped"]["not_finite"] == 0


def test_ranked_scores_that_are_not_finite_are_dropped(tmp_path):
    from rlhf.data import formats

    plan = formats.Plan("ranked", {"prompt": "prompt", "responses": "responses", "scores": "scores"})
    batch = {"prompt": ["p", "q"], "responses": [["a", "b"], ["c", "d"]], "scores": [[1.0, float("inf")], [2.0, 1.0]]}
    cands = formats.candidates(batch, [0, 1], plan, formats.ChatRenderer(None), formats.Markers("H:", "A:"))
    assert [c.reason for c in cands] == ["not_finite", None] and cands[1].margin == 1.0


def test_an_empty_file_is_refused_before_anything_is_loaded(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"data.path: .*pairs.jsonl has no rows"):
        check_source(DataConfig(source="local", path=str(path)))
