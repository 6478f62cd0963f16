"""Entry point: `connector` (or `python -m connector`)."""

from __future__ import annotations

from tbmq_platform.lifecycle import run
from tbmq_platform.settings import load_or_exit

from .service import ConnectorService
from .settings import ConnectorSettings


def main() -> None:
    settings = load_or_exit(ConnectorSettings)
    run(settings, ConnectorService)


if __name__ == "__main__":
    main()
