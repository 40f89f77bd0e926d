"""Command-line flags generated from config dataclasses (``common.config``): every supported
type round-trips through ``config_argv`` → ``parse_config``, nested configs are flattened with
a prefix, help comes from the field docstrings, and a bad value exits with status 2 and one
line on stderr."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from common.config import build_parser, config_argv, field_docs, parse_config
from services.supervisor.config import SupervisorConfig
from services.worker.config import WorkerConfig


@dataclass(frozen=True)
class Inner:
    """A nested config."""

    size: int = 4
    """Blocks per thing."""
    label: str = "x"
    """A label."""


@dataclass(frozen=True)
class Sample:
    """Every supported field type."""

    name: str = "plain"
    """A plain string."""
    count: int = 3
    """How many, at least one."""
    ratio: float = 0.25
    """A fraction (0.1 % is fine)."""
    flag: bool = False
    """Off unless asked for."""
    on: bool = True
    """On unless turned off."""
    path: Path = Path("some/dir")
    """Where things live."""
    maybe: str | None = None
    """Optional text."""
    maybe_n: int | None = 7
    """Optional number with a default."""
    ids: tuple[str, ...] = ("a",)
    """Comma-separated ids."""
    sizes: tuple[int, ...] = ()
    """Comma-separated numbers."""
    mode: Literal["fast", "slow"] = "fast"
    """Choice of two."""
    inner: Inner = field(default_factory=Inner)
    """The nested part."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")


CHANGED = Sample(
    name="with spaces, and -dashes",
    count=9,
    ratio=1e-7,
    flag=True,
    on=False,
    path=Path("/abs/path"),
    maybe="text",
    maybe_n=None,
    ids=("e0", "e1", "e2"),
    sizes=(1, 2, 3),
    mode="slow",
    inner=Inner(size=16, label="-starts-with-dash"),
)


def test_defaults_need_no_flags() -> None:
    assert config_argv(Sample()) == []
    assert parse_config(Sample, []) == Sample()


@pytest.mark.parametrize("f", [f.name for f in dataclasses.fields(Sample)])
def test_every_field_round_trips(f: str) -> None:
    config = dataclasses.replace(Sample(), **{f: getattr(CHANGED, f)})
    argv = config_argv(config)
    assert argv, f"{f} changed but emitted no flag"
    assert parse_config(Sample, argv) == config


def test_everything_changed_round_trips() -> None:
    assert parse_config(Sample, config_argv(CHANGED)) == CHANGED


def test_flags_are_dashed_field_names_nested_with_a_prefix() -> None:
    argv = config_argv(CHANGED)
    flags = [a.split("=", 1)[0] for a in argv]
    assert "--maybe-n" in flags and "--inner-size" in flags and "--inner-label" in flags
    assert "--flag" in flags and "--no-on" in flags
    assert "--ids=e0,e1,e2" in argv and "--mode=slow" in argv


def test_parsing_by_hand() -> None:
    config = parse_config(
        Sample,
        ["--ids", " e0, e1 ,", "--inner-size", "2", "--no-on", "--maybe-n", "", "--path", "p"],
    )
    assert config.ids == ("e0", "e1") and config.inner == Inner(size=2)
    assert config.on is False and config.maybe_n is None and config.path == Path("p")


def test_unchanged_nested_keeps_its_default_instance() -> None:
    assert parse_config(Sample, ["--count", "2"]).inner == Inner()


def test_a_value_the_command_line_cannot_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="--ids"):
        config_argv(dataclasses.replace(Sample(), ids=("a,b",)))
    with pytest.raises(ValueError, match="--maybe"):
        config_argv(dataclasses.replace(Sample(), maybe=""))  # "" means None on the command line


def test_help_comes_from_field_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    assert field_docs(Sample)["count"] == "How many, at least one."
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Sample, ["--help"], prog="sample", description="A sample service.")
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "A sample service." in out
    assert "--count INT How many, at least one. (default: 3)" in out
    assert "--inner-size INT Blocks per thing. (default: 4)" in out
    assert "(0.1 % is fine)" in out
    assert "--mode {fast,slow}" in out
    assert "The nested part." in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--count", "many"], "invalid int value: 'many'"),
        (["--count", "0"], "count must be >= 1, got 0"),  # ValueError from __post_init__
        (["--mode", "medium"], "invalid choice: 'medium'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_value_exits_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Sample, argv, prog="sample")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sample: error: ") and needle in err
    assert "Traceback" not in err


def test_unsupported_type_is_named() -> None:
    @dataclass(frozen=True)
    class Bad:
        things: list[str] = field(default_factory=list)
        """Lists are not supported."""

    with pytest.raises(TypeError, match=r"Bad\.things"):
        build_parser(Bad)


def test_service_configs_round_trip() -> None:
    """The real configs: a worker with nested engine limits, and the supervisor forwarding
    every child's config (the knobs are declared once, in the child's config)."""
    worker = WorkerConfig(engine_id="e3", hang_threshold_s=3.5, heartbeat_file="/tmp/hb")
    worker = dataclasses.replace(worker, engine=dataclasses.replace(worker.engine, max_num_seqs=4))
    assert parse_config(WorkerConfig, config_argv(worker)) == worker
    assert "--engine-max-num-seqs=4" in config_argv(worker)
    sup = SupervisorConfig(
        engines=2,
        router=dataclasses.replace(SupervisorConfig().router, recovery="baseline"),
        worker=worker,
    )
    argv = config_argv(sup)
    assert "--worker-hang-threshold-s=3.5" in argv and "--router-recovery=baseline" in argv
    assert parse_config(SupervisorConfig, argv) == sup
    assert sup.recovery == "baseline"


def test_every_service_config_field_is_documented() -> None:
    from services.environment.config import EnvConfig
    from services.kv.config import KvArenaConfig
    from services.router.config import RouterConfig
    from services.weights.config import WeightStoreConfig

    for cls in (
        SupervisorConfig,
        WorkerConfig,
        RouterConfig,
        KvArenaConfig,
        WeightStoreConfig,
        EnvConfig,
    ):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: no docstring for {missing}"
        build_parser(cls)  # every field type is supported
