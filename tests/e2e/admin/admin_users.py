"""The admin tests' edits of ADMIN_USERS_FILE, made as an operator's tool would: a new file, mode 0600, renamed
over the old one (the admin service reads it again when it changes)."""

from __future__ import annotations

import os
from pathlib import Path


def write_users(users: Path, text: str) -> None:
    staged = users.with_suffix(".next")
    staged.write_text(text)
    staged.chmod(0o600)
    os.replace(staged, users)
