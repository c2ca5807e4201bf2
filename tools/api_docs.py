#!/usr/bin/env python3
"""Renders membar's public Python API reference (HTML, from the docstrings) with pdoc, and checks it
for broken references.

    .venv/bin/python tools/api_docs.py                  # writes docs/api/index.html (make docs)
    .venv/bin/python tools/api_docs.py --check --out /tmp/api   # CI: exit 1 on a broken reference

Two checks, both over what is rendered:
  - every cross-reference written in a docstring (``:class:`X```, ``:func:``, ``:meth:``,
    ``:attr:``, ``:mod:``, and a backticked dotted name such as ``membar.x.y``) names an object that
    exists, looked up as Python would from the docstring's module (and class);
  - every link of the rendered pages that points inside the reference reaches an existing page
    and, with a #fragment, an element of that page.
Importing membar needs its compiled library (``make build``, or ``pip install .``).
"""
from __future__ import annotations

import argparse
import html.parser
import importlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ["membar", "membar.oomb", "membar.logra", "membar.runtime", "membar.integrations"]
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([\w.]+)`")
DOTTED = re.compile(r"(?<![`\w])`([A-Za-z_]\w*(?:\.\w+)+)`(?!`)")


def _resolve(name: str, module, owner=None) -> bool:
    """Whether `name` (absolute, or relative to `owner` then `module`) names an existing object."""
    parts = name.split(".")
    scopes = []
    if owner is not None:
        scopes.append(owner)
    scopes.append(module)
    for scope in scopes:
        target = scope
        for part in parts:
            if not hasattr(target, part):
                break
            target = getattr(target, part)
        else:
            return True
    for split in range(len(parts), 0, -1):   # an absolute dotted path: module part + attributes
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            if not hasattr(target, part):
                break
            target = getattr(target, part)
        else:
            return True
    return False


def broken_references(modules) -> list[str]:
    import pdoc.doc

    problems = []
    seen = set()

    def visit(doc, module, owner):
        key = (doc.fullname, id(doc))
        if key in seen:
            return
        seen.add(key)
        # A docstring inherited from another package (torch's nn.Module.forward, ...) is not ours to fix.
        origin = getattr(doc, "taken_from", (doc.modulename, ""))[0]
        ours = origin.split(".")[0] == doc.modulename.split(".")[0]
        text = (doc.docstring or "") if ours else ""
        scope = doc.obj if isinstance(doc, pdoc.doc.Class) else owner
        root = doc.modulename.split(".")[0]
        dotted = [name for name in DOTTED.findall(text) if name.split(".")[0] == root]
        for name in ROLE.findall(text) + dotted:
            if not _resolve(name, module, scope):
                problems.append(f"{doc.fullname}: reference to {name!r} names nothing")
        if isinstance(doc, pdoc.doc.Module):
            for member in doc.members.values():
                if isinstance(member, pdoc.doc.Module) or member.modulename == doc.modulename:
                    visit(member, member.obj if isinstance(member, pdoc.doc.Module) else module, None)
            for submodule in doc.submodules:
                visit(submodule, submodule.obj, None)
        elif isinstance(doc, pdoc.doc.Class):
            for member in doc.own_members:
                visit(member, module, doc.obj)

    for name in modules:
        module = importlib.import_module(name)
        visit(pdoc.doc.Module(module), module, None)
    return problems


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.add(attributes["id"])
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])


def broken_links(out: Path) -> list[str]:
    pages = {}
    for page in out.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text())
        pages[page.resolve()] = parser
    problems = []
    for page, parser in pages.items():
        for link in parser.links:
            if re.match(r"^[a-z]+:", link) or link == "":
                continue   # another site (or pdoc's link to the page itself)
            path, _, fragment = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if target not in pages:
                problems.append(f"{page.relative_to(out.resolve())}: link {link!r} reaches no page")
            elif fragment and not fragment.startswith("L-") and fragment not in pages[target].ids:
                problems.append(f"{page.relative_to(out.resolve())}: link {link!r} reaches no element")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "api"), help="output directory (default docs/api)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a reference or a link is broken")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "bindings" / "python"))
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", show_source=False,
                          footer_text="membar: generated by tools/api_docs.py")
    out = Path(args.out)
    pdoc.pdoc(*MODULES, output_directory=out)
    print(f"api_docs: wrote {out / 'index.html'}")
    if not args.check:
        return 0
    problems = broken_references(MODULES) + broken_links(out)
    for problem in problems:
        print(f"api_docs: {problem}", file=sys.stderr)
    print(f"api_docs: {len(problems)} broken reference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
