"""tbmq_auth.passwords.VerifiedPasswords: a password verified is known until its time is up; other passwords
and other stored hashes are not; bounded; off at 0; the password itself is not what is kept."""

from __future__ import annotations

import pytest
from tbmq_auth import make_credential
from tbmq_auth.passwords import HASH_COSTS, LOW, STANDARD, VerifiedPasswords, hash_password, verify_password

pytestmark = pytest.mark.unit


def test_a_verified_password_is_known_until_its_time_is_up():
    kept = VerifiedPasswords(60.0, 10)
    assert not kept.known("h1", b"pw", 100.0)
    kept.verified("h1", b"pw", 100.0)
    assert kept.known("h1", b"pw", 100.0) and kept.known("h1", "pw", 159.9)  # text or bytes: the same password
    assert not kept.known("h1", b"pw", 160.0) and len(kept) == 0  # 60 s after the check: dropped
    kept.verified("h1", b"pw", 170.0)  # verified again: kept again from then
    assert kept.known("h1", b"pw", 229.0) and len(kept) == 1


def test_another_password_or_another_stored_hash_is_not_known():
    kept = VerifiedPasswords(60.0, 10)
    kept.verified("h1", b"pw", 0.0)
    assert not kept.known("h1", b"guess", 1.0)
    assert not kept.known("h2", b"pw", 1.0)  # the credential replaced: a new hash, the old password not known
    assert not kept.known("h1", b"pw\0", 1.0) and not kept.known("h1\0", b"pw", 1.0)  # the two parts kept apart


def test_at_most_max_entries_the_one_verified_longest_ago_dropped_first():
    kept = VerifiedPasswords(60.0, 3)
    for i in range(4):
        kept.verified(f"h{i}", b"pw", float(i))
    assert len(kept) == 3 and not kept.known("h0", b"pw", 4.0)
    assert all(kept.known(f"h{i}", b"pw", 4.0) for i in (1, 2, 3))


def test_zero_keeps_nothing():
    kept = VerifiedPasswords(0.0, 10)
    kept.verified("h1", b"pw", 0.0)
    assert not kept and len(kept) == 0 and not kept.known("h1", b"pw", 0.0)


def test_what_is_kept_is_not_the_password_and_differs_per_process():
    """The key is a keyed BLAKE2b: the password is not in it, and another instance (another process) with its
    own random key keeps another value for the same password."""
    a, b = VerifiedPasswords(60.0, 10), VerifiedPasswords(60.0, 10)
    assert a._key("h1", b"pw") != b._key("h1", b"pw")
    assert b"pw" not in a._key("h1", b"pw") and len(a._key("h1", b"pw")) == 32
    a.verified("h1", b"pw", 0.0)
    assert not b.known("h1", b"pw", 0.0)


def test_the_hash_itself():
    stored = hash_password("s3cret")
    assert verify_password(stored, b"s3cret") and verify_password(stored, "s3cret")
    assert not verify_password(stored, b"wrong") and not verify_password("not-argon2", b"s3cret")


def test_a_hash_names_its_cost_and_verifies_whatever_its_cost():
    """STANDARD (RFC 9106 low memory) and LOW (OWASP's minimum for argon2id): the parameters are in the stored
    hash, so one verifier checks both; another cost is refused by name."""
    standard, low = hash_password("pw"), hash_password("pw", LOW)
    assert "$m=65536,t=3,p=4$" in standard and "$m=19456,t=2,p=1$" in low
    for stored in (standard, low):
        assert verify_password(stored, b"pw") and not verify_password(stored, b"other")
    assert HASH_COSTS == (STANDARD, LOW)
    with pytest.raises(ValueError, match="standard, low"):
        hash_password("pw", "none")


def test_a_credential_is_written_at_the_cost_asked_for():
    assert "$m=19456,t=2,p=1$" in make_credential("u", "pw", hash_cost=LOW).password_hash
    assert "$m=65536,t=3,p=4$" in make_credential("u", "pw").password_hash
    with pytest.raises(ValueError):
        make_credential("u", "pw", hash_cost="cheap")
    assert make_credential("u", None, cert_cn="dev", hash_cost="cheap").password_hash is None  # nothing hashed
