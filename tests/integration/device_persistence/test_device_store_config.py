"""StoreConfig, key naming and Lua directory resolution (no Redis needed)."""

from __future__ import annotations

import pytest

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig, default_lua_dir, hash_tag


def test_hash_tag_is_one_to_one():
    ids = ["", "%", "%%", "}", "%}", "a", "%a", "}a", "a}", "{a}"]
    tags = [hash_tag(i) for i in ids]
    assert len(set(tags)) == len(ids)
    assert all(t and t[0] != "}" for t in tags)


def test_config_validation(tmp_path):
    assert StoreConfig().messages_limit == 1_000_000 and StoreConfig().messages_ttl_s == 604800
    StoreConfig(messages_limit=1_000_000, handed_out_limit=65534)
    with pytest.raises(ValueError, match="MESSAGES_LIMIT"):
        StoreConfig(messages_limit=1_000_001)
    with pytest.raises(ValueError, match="BYTES_LIMIT"):
        StoreConfig(bytes_limit=1023)
    with pytest.raises(ValueError, match="HANDED_OUT_LIMIT"):
        StoreConfig(handed_out_limit=65535)
    with pytest.raises(ValueError, match="LIMIT"):
        StoreConfig(messages_limit=0)
    with pytest.raises(ValueError, match="TTL"):
        StoreConfig(messages_ttl_s=0)
    with pytest.raises(ValueError, match="braces"):
        StoreConfig(key_prefix="{x}")


def test_lua_dir_override(tmp_path, monkeypatch):
    assert (default_lua_dir() / "save_messages.lua").is_file()
    monkeypatch.setenv("TBMQ_LUA_DIR", str(tmp_path))
    assert default_lua_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="TBMQ_LUA_DIR"):
        DeviceMsgStore(StoreConfig())
