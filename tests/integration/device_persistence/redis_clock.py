"""Redis's own clock, as the device store's scripts read it (`TIME`): deadlines they write (state.exp) are compared
with it, not with this process's clock."""

from __future__ import annotations


async def redis_ms(r) -> int:
    """Redis's clock in ms (the scripts' `now`)."""
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000
