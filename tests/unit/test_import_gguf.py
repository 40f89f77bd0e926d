"""``belayer model import`` on bad input: one clear error line, exit 2, nothing written.

The GGUF files here are tiny ones written with the ``gguf`` package: a header with a token list
and one small tensor (enough for every check that precedes the conversion), and a whole tiny
Qwen3 or Llama laid out as llama.cpp's converter writes it (GGUF tensor names, Llama's q/k rows
permuted, the tokenizer as metadata), which must come back bitwise. The conversion of a real
checkpoint is in ``tests/integration/test_smollm2.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, TokenType

from common.errors import InvalidRequest
from model.config import load_model_config
from model.import_gguf import check_gguf, import_gguf, package_gguf
from model.loader import load_safetensors
from model.tiny import init_tiny_model
from model.tokenizer import load_tokenizer

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
"""HF parameter name (in a layer) → llama.cpp's GGUF tensor name (in ``blk.N``)."""


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


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a Llama q or k projection (``heads`` of them)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_model_gguf(hf_dir: Path, path: Path) -> Path:
    """The tiny HF model ``hf_dir`` as a GGUF file, as llama.cpp's converter lays it out."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {a["id"] for a in tok["added_tokens"]}
    llama = cfg["model_type"] == "llama"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(str(path), cfg["model_type"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(tokens))]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    tensors = {k: v.numpy() for k, v in load_safetensors(hf_dir).items()}
    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors:
        w.add_tensor("output.weight", tensors["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in GGUF_NAMES.items():
            x = tensors.get(f"model.layers.{i}.{hf_name}.weight")
            if x is None:  # Llama has no q/k norms
                continue
            if llama and gguf_name in ("attn_q", "attn_k"):
                x = llama_cpp_permute(x, heads if gguf_name == "attn_q" else kv_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_tiny_model_comes_back_bitwise_through_gguf(tmp_path: Path, model_type: str) -> None:
    src = init_tiny_model(
        tmp_path / "src", hidden_size=192, num_layers=2, num_heads=6, num_kv_heads=2,
        head_dim=32, intermediate_size=256, vocab_size=1024, model_type=model_type,
    )  # fmt: skip
    out = import_gguf(write_model_gguf(src, tmp_path / "tiny.gguf"), tmp_path / "out")
    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert names | {"tokenizer_config.json", "chat_template.jinja"} == {
        p.name for p in out.iterdir()
    }
    ours, theirs = load_safetensors(out), load_safetensors(src)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)  # q/k rows un-permuted
    a, b = load_model_config(src), load_model_config(out)
    assert (b.model_type, b.tie_word_embeddings, b.rope_theta, b.num_kv_groups) == (
        a.model_type, a.tie_word_embeddings, a.rope_theta, a.num_kv_groups,
    )  # fmt: skip
    text = "What is 12 + 7? The answer is 19.<|im_end|>"
    assert load_tokenizer(out).encode(text) == load_tokenizer(src).encode(text)
    assert load_tokenizer(out).eos_token_ids == (load_tokenizer(src).token_to_id("<|im_end|>"),)
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()


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
