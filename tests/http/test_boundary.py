"""`app.http` is a library under the app: it imports nothing from the rest of `app/`."""

from __future__ import annotations

import ast
from pathlib import Path

import app.http

HTTP_DIR = Path(app.http.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add("app.http" if node.level == 1 else "app")
    return names


def test_the_http_package_imports_nothing_from_the_rest_of_the_app() -> None:
    modules = sorted(HTTP_DIR.glob("*.py"))
    assert len(modules) >= 5  # server, connection, exchange, client, asgi
    for path in modules:
        outside = {
            m for m in imported_modules(path) if (m == "app" or m.startswith("app.")) and not m.startswith("app.http")
        }
        assert not outside, f"{path.name} imports {sorted(outside)}: app.http must not depend on the app"
