"""End-to-end tests: makes this folder's shared helpers (mqtt_clients.py) importable by every module below it.

The folders under tests/e2e are not packages; pytest (import mode "prepend", pytest.ini) puts each test
module's own folder on sys.path. This folder is added once here as well, so `from mqtt_clients import ...`
works from any of them, whatever the import mode. (Its sub-folders named like services, e.g. device_persistence,
cannot shadow those: they have no __init__.py, and a regular package always wins over a namespace one.)
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
