"""The GPU path's pure parts, on the CPU: the device choice (``--device auto|cpu|cuda``), the engine
backend choice (``--engine-backend belayer|sglang``) and their one-line refusals, the sglang
backend's mapping of sampling parameters and streamed chunks, and the CPU behaviour of the
engine and the trainer with the device given explicitly (unchanged). Nothing here runs on a
GPU; ``deploy/device/check.sh`` is the check for one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer

from common.config import parse_config
from common.device import DEVICE_CHOICES, DeviceUnavailable, resolve_device
from common.errors import FatalError
from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from services.trainer.config import TrainerConfig
from services.trainer.update import new_state
from services.worker.backends import build_engine
from services.worker.config import WorkerConfig
from services.worker.engine.backend import BACKENDS, check_backend
from services.worker.engine.config import EngineConfig
from services.worker.engine.sequence import SamplingParams
from services.worker.sglang_engine import finish_reason, new_tokens, sampling_params
from tests.unit.model_fixtures import write_small_model

torch.set_num_threads(1)


def _no_cuda() -> bool:
    return False


def _cuda() -> bool:
    return True


def test_device_choices_resolve() -> None:
    assert DEVICE_CHOICES == ("auto", "cpu", "cuda")
    assert resolve_device("cpu", has_cuda=_cuda) == "cpu"
    assert resolve_device("auto", has_cuda=_no_cuda) == "cpu"
    assert resolve_device("auto", has_cuda=_cuda) == "cuda"
    assert resolve_device("cuda", has_cuda=_cuda) == "cuda"


def test_cuda_without_a_gpu_is_one_clear_line() -> None:
    with pytest.raises(DeviceUnavailable) as err:
        resolve_device("cuda", has_cuda=_no_cuda)
    assert "no CUDA device" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DeviceUnavailable, match="one of auto, cpu, cuda"):
        resolve_device("gpu")


def test_device_and_backend_flags(capsys: pytest.CaptureFixture[str]) -> None:
    c = parse_config(WorkerConfig, ["--device", "auto", "--engine-backend", "sglang"])
    assert (c.device, c.engine_backend) == ("auto", "sglang")
    assert WorkerConfig().device == "cpu" and WorkerConfig().engine_backend == "belayer"
    assert parse_config(TrainerConfig, ["--device", "cuda"]).device == "cuda"
    for argv in (["--device", "gpu"], ["--engine-backend", "vllm"]):
        with pytest.raises(SystemExit) as exit_:
            parse_config(WorkerConfig, argv)
        assert exit_.value.code == 2
    assert capsys.readouterr().err.count("error:") == 2


def test_backend_selection_refuses_what_this_machine_cannot_run() -> None:
    assert BACKENDS == ("belayer", "sglang")
    check_backend("belayer", "cpu")
    check_backend("belayer", "cuda")
    check_backend("sglang", "cuda", has_sglang=_cuda)
    with pytest.raises(ValueError, match="runs on a GPU only") as err:
        check_backend("sglang", "cpu", has_sglang=_cuda)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs the sglang package"):
        check_backend("sglang", "cuda", has_sglang=_no_cuda)
    with pytest.raises(ValueError, match="one of belayer, sglang"):
        check_backend("tgi", "cpu")


def test_belayer_up_device_args(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.node import check_device_args

    check_device_args("cpu", "belayer")  # the default: nothing asked of torch
    bad = [("gpu", "belayer"), ("cpu", "vllm"), ("cpu", "sglang")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "belayer"))
    for device, backend in bad:
        with pytest.raises(typer.Exit) as exit_:
            check_device_args(device, backend)
        assert exit_.value.exit_code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(bad) and all(line.startswith("error: ") for line in lines)


def test_trainer_device_refusals() -> None:
    assert TrainerConfig().resolved_device() == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusals below need one without")
    with pytest.raises(FatalError, match="no CUDA device"):
        TrainerConfig(device="cuda").resolved_device()
    assert TrainerConfig(device="auto", procs=2, deterministic=True).resolved_device() == "cpu"


def test_sglang_sampling_mapping() -> None:
    greedy = sampling_params(SamplingParams(temperature=0, max_tokens=7, seed=3))
    assert greedy == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": 7,
        "stop_token_ids": [],
        "ignore_eos": False,
    }
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=11, stop_token_ids=(5,))
    assert sampling_params(sampled)["sampling_seed"] == 11
    assert sampling_params(sampled)["stop_token_ids"] == [5]


def test_sglang_stream_chunks_become_new_tokens() -> None:
    # Whole output so far (SGLang's default) and increments only: the same new tokens.
    whole = {"completion_tokens": 3, "output_token_logprobs": [(-0.1, 7, None), (-0.2, 8, None), (-0.3, 9, None)]}  # fmt: skip
    assert new_tokens(whole, 1) == ([8, 9], [-0.2, -0.3], 3)
    increment = {"completion_tokens": 3, "output_token_logprobs": [(-0.2, 8, None), (-0.3, 9, None)]}  # fmt: skip
    assert new_tokens(increment, 1) == ([8, 9], [-0.2, -0.3], 3)
    assert new_tokens({"completion_tokens": 3}, 3) == ([], [], 3)
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason({"finish_reason": {"type": "length", "length": 7}}) == "length"
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    assert finish_reason({"finish_reason": {"type": "abort"}}) == "abort"


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("gpu-path-model"))


def test_engine_on_cpu_unchanged_and_cuda_refuses_deterministic(small_model_dir: Path) -> None:
    cfg = load_model_config(small_model_dir)
    params = load_safetensors(small_model_dir)
    ec = EngineConfig(num_blocks=32, max_model_len=128, max_num_batched_tokens=512)

    def kv() -> torch.Tensor:
        return torch.zeros(kv_cache_shape(cfg, ec.num_blocks, ec.block_size))

    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    default = build_engine("belayer", cfg, params, kv(), ec, device="cpu", model_dir="")
    arena = kv()
    explicit = build_engine("belayer", cfg, params, arena, ec, device="cpu", model_dir="")
    a = default.generate([[5, 17, 301]], sampling)[0]  # type: ignore[attr-defined]
    b = explicit.generate([[5, 17, 301]], sampling)[0]  # type: ignore[attr-defined]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert bool(arena.any())  # on the CPU the arena's memory is the cache, used in place
    with pytest.raises(ValueError, match="deterministic mode runs on the CPU only"):
        build_engine("belayer", cfg, params, kv(), ec, device="cuda", model_dir="")


def test_trainer_state_on_cpu_is_a_copy_on_cpu(small_model_dir: Path) -> None:
    cfg = load_model_config(small_model_dir)
    params = load_safetensors(small_model_dir)
    state = new_state(cfg, params, 1, TrainerConfig().optim, device="cpu")
    for name, p in state.model.named_parameters():
        assert p.device.type == "cpu"
        if name in params:
            assert torch.equal(p.detach(), params[name])
            assert p.data_ptr() != params[name].data_ptr()
