"""Every product module (server/, engine/, kvcache/) stays small enough to read: no module over 500 lines, no function
over 80."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = sorted(path for package in ("server", "engine", "kvcache") for path in (REPO / package).rglob("*.py"))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in CHECKED if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_80_lines():
    long = {}
    for path in CHECKED:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = length
    assert long == {}
