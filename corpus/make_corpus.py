"""Rebuild the derived corpus files from texts installed on a Debian machine.

Run from the repo root: `python corpus/make_corpus.py`. The hand-written
`prose-*.txt` files are not generated; they are original text (CC0). The
`train-only/` documents (the standard library's docstrings) are rendered into
training pages only, never held out.
Every output is normalised the same way as `normalise()` below so the
renderer only ever sees printable ASCII.
"""
import ast
import importlib.util
import re
import sys
import unicodedata
from pathlib import Path

OUT = Path(__file__).resolve().parent
LICENSES = Path("/usr/share/common-licenses")
PYLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"

# Typographic characters that have a natural ASCII spelling; anything else non-ASCII is dropped.
ASCII_SPELLING = {"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u201c": '"', "\u201d": '"',
                  "\u201e": '"', "\u2013": "-", "\u2014": "--", "\u2212": "-", "\u2026": "...", "\u00a0": " ",
                  "\u00d7": "x", "\u2022": "*", "\u00ab": '"', "\u00bb": '"'}
RULE = re.compile(r"^\s*([*=\-~^#_+.])\1{2,}\s*$")  # heading underlines and separators


def normalise(text):
    """Printable ASCII, one paragraph per line, single spaces inside paragraphs."""
    text = "".join(ASCII_SPELLING.get(ch, ch) for ch in text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = text.replace("\f", "\n").replace("\t", " ")
    lines = ["" if RULE.match(line) else line for line in text.splitlines()]
    paragraphs = re.split(r"\n\s*\n", "\n".join(lines))
    paragraphs = [" ".join("".join(ch for ch in p if " " <= ch <= "~" or ch == "\n").split()) for p in paragraphs]
    return "\n".join(p for p in paragraphs if p) + "\n"


# Versions of the same licence share a family prefix (e.g. gpl-2, gpl-3) so the
# splitter can keep near-duplicates together.
LICENSE_FILES = {"apache-2.0": "Apache-2.0", "artistic-1.0": "Artistic", "bsd-3-clause": "BSD",
                 "cc0-1.0": "CC0-1.0", "gfdl-1.2": "GFDL-1.2", "gfdl-1.3": "GFDL-1.3", "gpl-1": "GPL-1",
                 "gpl-2": "GPL-2", "gpl-3": "GPL-3", "lgpl-2": "LGPL-2", "lgpl-2.1": "LGPL-2.1",
                 "lgpl-3": "LGPL-3", "mpl-1.1": "MPL-1.1", "mpl-2.0": "MPL-2.0"}

# pydoc topics are sections of the Python Language Reference / Library Reference (PSF licence).
PYTHON_TOPICS = {
    "python-execution-model": ["execmodel", "exceptions", "dynamic-features"],
    "python-data-model": ["objects", "types"],
    "python-special-methods": ["specialnames"],
    "python-compound-statements": ["compound"],
    "python-simple-statements": ["assignment", "augassign", "assert", "pass", "del", "return", "yield",
                                 "raise", "break", "continue", "import", "global", "nonlocal"],
    "python-expressions": ["atom-identifiers", "atom-literals", "attribute-references", "subscriptions",
                           "slicings", "calls", "await", "power", "unary", "binary", "shifting", "bitwise",
                           "comparisons", "booleans", "lambda", "exprlists", "operator-summary"],
    "python-lexical-analysis": ["identifiers", "strings", "integers", "floating", "imaginary"],
    "python-string-methods": ["string-methods"],
    "python-format-strings": ["formatstrings"],
    "python-sequence-types": ["typesseq", "typesseq-mutable", "typesmapping", "truth"],
    "python-numeric-and-other-types": ["numeric-types", "typesfunctions", "typesmethods", "typesmodules",
                                       "bltin-code-objects", "bltin-type-objects", "bltin-null-object",
                                       "bltin-ellipsis-object", "specialattrs", "conversions"],
    "python-debugger": ["debugger"],
}


TRAIN_ONLY = OUT / "train-only"
# not prose of the library's own: tests, the IDE and GUI demos, vendored wheels, and pydoc's topics (the
# reference manual, parts of which are held-out documents above)
NOT_DOCSTRINGS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages", "pydoc_data"}


def stdlib_docstrings(min_chars=300, min_document=2000):
    """{name: text} of the standard library's longer docstrings (modules, classes, functions), one
    document per top-level module or package, in file and then tree order."""
    groups = {}
    for path in sorted(PYLIB.rglob("*.py")):
        parts = path.relative_to(PYLIB).parts
        if NOT_DOCSTRINGS & set(parts):
            continue
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [d for node in ast.walk(tree) if isinstance(node, nodes) and len(d := ast.get_docstring(node) or "") >= min_chars]
        groups.setdefault(Path(parts[0]).stem.lstrip("_"), []).extend(docs)
    texts = {name: normalise("\n\n".join(docs)) for name, docs in sorted(groups.items())}
    return {name: text for name, text in texts.items() if len(text) >= min_document}


def main():
    for name, src in LICENSE_FILES.items():
        (OUT / f"license-{name}.txt").write_text(normalise((LICENSES / src).read_text("utf-8")))
    (OUT / "python-license.txt").write_text(normalise((PYLIB / "LICENSE.txt").read_text("utf-8")))
    spec = importlib.util.spec_from_file_location("topics", PYLIB / "pydoc_data" / "topics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, keys in PYTHON_TOPICS.items():
        (OUT / f"{name}.txt").write_text(normalise("\n\n".join(module.topics[k] for k in keys)))
    TRAIN_ONLY.mkdir(exist_ok=True)
    for name, text in stdlib_docstrings().items():
        (TRAIN_ONLY / f"python-stdlib-{name}.txt").write_text(text)


if __name__ == "__main__":
    main()
