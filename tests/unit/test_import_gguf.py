"""``belayer model import`` on bad input: one clear error line, exit 2, nothing written.

The GGUF files here are tiny ones written with the ``gguf`` package (header and a token list,
one small tensor): enough for every check that precedes the conversion. The conversion of a real
checkpoint is in ``tests/integration/test_smollm2.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from common.errors import InvalidRequest
from model.import_gguf import check_gguf, import_gguf, package_gguf
from model.tiny import init_tiny_model


def write_gguf(path: Path, arch: str, *, tokenizer: bool = True) -> Path:
    """A minimal GGUF file of architecture ``arch``, with or without a tokenizer."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "<|im_end|>"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def belayer_import(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "model", "import", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_header_checks_name_the_problem(tmp_path: Path) -> None:
    assert check_gguf(write_gguf(tmp_path / "ok.gguf", "llama")) == "llama"
    assert check_gguf(write_gguf(tmp_path / "q.gguf", "qwen3")) == "qwen3"
    cases = {
        write_gguf(tmp_path / "gpt2.gguf", "gpt2"): r"architecture 'gpt2' cannot be served "
        r"by Belayer \(only qwen3, llama\)",
        write_gguf(tmp_path / "bare.gguf", "llama", tokenizer=False): "has no tokenizer",
        tmp_path / "absent.gguf": "cannot read",
        tmp_path: "is a directory, not a GGUF file",
        init_tiny_model(tmp_path / "hf", hidden_size=64, num_layers=1, head_dim=16,
                        intermediate_size=64, vocab_size=512): "Hugging Face model directory "
        "already: use it as is",
    }  # fmt: skip
    (tmp_path / "text.gguf").write_text("not a checkpoint")
    cases[tmp_path / "text.gguf"] = r"is not a GGUF file \(it does not start with 'GGUF'\)"
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    cases[tmp_path / "cut.gguf"] = "is not a readable GGUF file"
    for path, message in cases.items():
        with pytest.raises(InvalidRequest, match=message):
            check_gguf(path)


def test_a_package_without_a_gguf_file_is_named() -> None:
    with pytest.raises(InvalidRequest, match="'no-such-belayer-pkg' is not installed"):
        package_gguf("no-such-belayer-pkg")
    with pytest.raises(InvalidRequest, match=r"'pytest' ships no \.gguf file"):
        package_gguf("pytest")


def test_import_refuses_a_non_empty_output_and_writes_nothing_on_bad_input(
    tmp_path: Path,
) -> None:
    good = write_gguf(tmp_path / "ok.gguf", "llama")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(InvalidRequest, match="exists and is not an empty directory"):
        import_gguf(good, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    out = tmp_path / "out"
    with pytest.raises(InvalidRequest, match="architecture 'gpt2'"):
        import_gguf(write_gguf(tmp_path / "gpt2.gguf", "gpt2"), out)
    assert not out.exists() and not (tmp_path / "out.importing").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "exactly one of --gguf FILE and --from-package PACKAGE"),
        (["--from-package", "no-such-belayer-pkg"], "is not installed"),
        (["--gguf", "{tmp}/text.gguf"], "is not a GGUF file"),
        (["--gguf", "{tmp}/gpt2.gguf"], "cannot be served by Belayer"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path: Path, args: list[str], words: str) -> None:
    (tmp_path / "text.gguf").write_text("not a checkpoint")
    write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    out = tmp_path / "out"
    proc = belayer_import(*(a.format(tmp=tmp_path) for a in args), str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert not out.exists()
