"""``python -m services.shadow``: the prepared standby of one engine (takes over on failure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.shadow.service import run
from services.worker.__main__ import parse


def main(argv: list[str] | None = None) -> int:
    config = dataclasses.replace(parse(argv), role="shadow")
    configure(
        f"shadow:{config.engine_id}", log_file=Path(config.log_file) if config.log_file else None
    )
    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    raise SystemExit(main())
