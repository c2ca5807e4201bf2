"""The README's Python snippet runs as written (on the CPU), and its links to files of the
repository lead somewhere."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_the_python_snippet_runs_as_written(tmp_path):
    section = README[README.index("## Using it from Python"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    environment = dict(os.environ, PYTHONPATH=str(REPO / "bindings" / "python"), OMP_NUM_THREADS="1")
    finished = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path, env=environment)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert re.search(r"loss \d+\.\d+, [\d,]+ tokens/s in 8 chunks", finished.stdout), finished.stdout


def test_links_to_repository_files_exist():
    for document in (REPO / "README.md", REPO / "docs" / "results.md"):
        text = document.read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (document.parent / target).exists(), f"{document.name} links to {target}, which is not there"
