"""The admin service's first user for `make run` and the tests: `admin` with a generated password.

`<run dir>/admin-password` holds the password and `<run dir>/admin-users` the users file the admin service
reads (ADMIN_USERS_FILE: `username:argon2id-hash` lines), both mode 0600. Idempotent: a password once
generated is kept across runs (and the users file rewritten only when it does not verify it).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

USER = "admin"


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def ensure_admin_user(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """(password file, users file) under `run_dir`, created when missing."""
    from argon2 import PasswordHasher
    from argon2.exceptions import InvalidHashError, VerificationError

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pw_file, users_file = run_dir / "admin-password", run_dir / "admin-users"
    password = pw_file.read_text().strip() if pw_file.exists() else ""
    if not password:
        password = secrets.token_urlsafe(18)
        _write_private(pw_file, password + "\n")
    os.chmod(pw_file, 0o600)
    hasher = PasswordHasher()
    current = users_file.read_text() if users_file.exists() else ""
    ok = False
    for line in current.splitlines():
        name, _, rest = line.strip().partition(":")
        digest = rest.partition(":")[0]  # username:argon2-hash[:role] (the admin service's users file)
        if name == USER:
            try:
                ok = hasher.verify(digest, password)
            except (VerificationError, InvalidHashError):
                ok = False
    if not ok:
        others = [ln for ln in current.splitlines() if ln.strip() and ln.partition(":")[0].strip() != USER]
        _write_private(users_file, "\n".join([*others, f"{USER}:{hasher.hash(password)}"]) + "\n")
    os.chmod(users_file, 0o600)
    return pw_file, users_file
