"""`assert_imports_none_of(package, banned)`: a pure library's modules import nothing of `banned` (top-level
names), checked on their source (tests of tbmq_connection and tbmq_auth)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def assert_imports_none_of(package: ModuleType, banned: set[str]) -> None:
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"
