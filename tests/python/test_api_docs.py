"""tools/api_docs.py: the API reference renders, with no broken reference or link; and the check
does catch a reference that names nothing."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("pdoc", reason="pdoc is not installed (tools/setup.sh installs it)")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "api_docs.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("api_docs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_renders_without_broken_references(tmp_path, capsys):
    assert load_tool().main(["--check", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "membar" / "oomb.html").exists() and (tmp_path / "membar" / "integrations" / "oomb.html").exists()


def test_a_reference_to_nothing_is_reported(tmp_path, monkeypatch):
    package = tmp_path / "docs_probe"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""Uses :class:`Real` and :func:`missing_function`; see `docs_probe.Real.method` and `docs_probe.Gone`."""\n'
        "class Real:\n"
        '    """Calls :meth:`method` and :meth:`absent`."""\n'
        "    def method(self):\n"
        '        """Nothing."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = load_tool().broken_references(["docs_probe"])
    sys.modules.pop("docs_probe", None)
    assert sorted(p.split("reference to ")[1] for p in problems) == [
        "'absent' names nothing", "'docs_probe.Gone' names nothing", "'missing_function' names nothing"]
