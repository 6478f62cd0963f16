"""Entry point: `app-delivery` (or `python -m app_delivery`)."""

from __future__ import annotations

from tbmq_platform.lifecycle import run

from .service import AppDeliveryService
from .settings import load_settings_or_exit


def main() -> None:
    settings = load_settings_or_exit()
    run(settings, AppDeliveryService)


if __name__ == "__main__":
    main()
