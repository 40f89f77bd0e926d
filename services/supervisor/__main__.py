"""Belayer node supervisor: starts NATS and the services, restarts crashed ones (``belayer up``
runs it). The nested ``--<service>-*`` flags are each service's own config, forwarded to it."""

from common.service import exit_process, main
from services.supervisor.config import SupervisorConfig
from services.supervisor.service import run

if __name__ == "__main__":
    exit_process(
        main(
            SupervisorConfig,
            run,
            name="supervisor",
            prog="python -m services.supervisor",
            description=__doc__,
        )
    )
