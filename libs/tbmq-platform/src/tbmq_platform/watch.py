"""Files a running service reads again when they change (TLS certificates, CA bundles, CRLs, key sets): what
tells a changed file, compared between two checks."""

from __future__ import annotations

import os
from collections.abc import Iterable


def file_stamps(paths: Iterable[str]) -> tuple:
    """What tells a changed file (modification time, size, inode; None when missing), per path."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


__all__ = ["file_stamps"]
