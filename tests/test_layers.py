"""The layers of vitgraph hold (pyproject.toml's [tool.importlinter] contracts, written down in
docs/design.md): no import back up, no circle, function-level imports included."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_follow_the_layers():
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is not installed "
                                                         "(pip install -e .[test])")
    # 0: every contract kept; the report above the assertion names any import that breaks one
    assert cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
