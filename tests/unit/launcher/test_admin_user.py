"""`make run`'s admin user: a generated password in <run dir>/admin-password and its argon2id hash in the users
file the admin service reads, both 0600, kept across runs."""

from __future__ import annotations

import stat

import pytest
from admin.auth import load_users, verify
from tbmq_launcher.admin_user import ensure_admin_user

pytestmark = pytest.mark.unit


def test_generated_once_private_and_verifiable(tmp_path):
    pw_file, users_file = ensure_admin_user(tmp_path)
    password = pw_file.read_text().strip()
    assert len(password) >= 20
    for f in (pw_file, users_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert verify(load_users(users_file), "admin", password)
    hashed = users_file.read_text()
    ensure_admin_user(tmp_path)  # idempotent: same password, users file untouched
    assert pw_file.read_text().strip() == password and users_file.read_text() == hashed
    # a users file that no longer matches (password file edited) is rewritten, other users kept
    pw_file.write_text("new-password\n")
    users_file.write_text(hashed + "ops:" + hashed.partition(":")[2])
    ensure_admin_user(tmp_path)
    users = load_users(users_file)
    assert verify(users, "admin", "new-password") and "ops" in users


def test_a_role_on_the_admin_line_is_kept_while_the_password_matches(tmp_path):
    pw_file, users_file = ensure_admin_user(tmp_path)
    line = users_file.read_text().strip()
    users_file.write_text(f"{line}:admin\nwatch:{line.partition(':')[2]}:viewer\n")
    ensure_admin_user(tmp_path)  # the hash is still the password's: nothing rewritten
    users = load_users(users_file)
    assert users_file.read_text().startswith(line + ":admin\n") and users["watch"].role == "viewer"
    assert verify(users, "admin", pw_file.read_text().strip())
