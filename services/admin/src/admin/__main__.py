"""Entry point: `admin` (or `python -m admin`)."""

from __future__ import annotations

from tbmq_platform.lifecycle import run

from .service import AdminService
from .settings import load_settings_or_exit


def main() -> None:
    settings = load_settings_or_exit()
    run(settings, AdminService)


if __name__ == "__main__":
    main()
