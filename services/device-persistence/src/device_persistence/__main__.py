"""Entry point: `device-persistence` (or `python -m device_persistence`)."""

from __future__ import annotations

from tbmq_platform.lifecycle import run

from tbmq_device_persistence.service import DevicePersistenceService
from tbmq_device_persistence.settings import load_settings_or_exit


def main() -> None:
    settings = load_settings_or_exit()
    run(settings, DevicePersistenceService)


if __name__ == "__main__":
    main()
