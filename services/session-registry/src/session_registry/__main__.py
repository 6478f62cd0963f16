"""Entry point: `session-registry` (or `python -m session_registry`)."""

from __future__ import annotations

from tbmq_platform.lifecycle import run
from tbmq_platform.settings import load_or_exit

from .service import SessionRegistry
from .settings import SessionRegistrySettings


def main() -> None:
    settings = load_or_exit(SessionRegistrySettings)
    run(settings, SessionRegistry)


if __name__ == "__main__":
    main()
