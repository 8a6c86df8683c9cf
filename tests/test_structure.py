"""The shape of the code: one import namespace, no import cycle, no sys.path edits, no function over
120 lines outside tests, and every setting documented in README's configuration table."""
import ast
import re
import subprocess
import sys
from pathlib import Path

from ocr_latent.serving.settings import variables

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for p in ROOT.rglob("*.py") if not {".venv", "tests", "build"} & set(p.relative_to(ROOT).parts)]
PACKAGE = [p for p in SOURCES if p.relative_to(ROOT).parts[0] not in ("bench", "deploy")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("ocr_latent", *parts)).removesuffix(".__init__")


def test_no_function_is_over_120_lines():
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in SOURCES for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 120]
    assert not long, long


def test_nothing_edits_sys_path():
    assert not [p for p in SOURCES if re.search(r"sys\.path\s*(\.|\[|=|\+)", p.read_text())]


def test_module_level_imports_form_no_cycle():
    graph = {}
    for p in PACKAGE:
        deps = set()
        for n in ast.parse(p.read_text()).body:  # module level: what importing the module imports
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("ocr_latent"):
                deps.add(n.module)
                deps.update(f"{n.module}.{a.name}" for a in n.names)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names if a.name.startswith("ocr_latent"))
        graph[module_name(p)] = deps
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, f"import cycle: {' -> '.join(path + [d])}"
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_only_the_namespace_is_importable_from_outside():
    code = ("import importlib.util as u; "
            "print([m for m in ('server', 'engine', 'pages', 'client', 'decoder') if u.find_spec(m)], "
            "u.find_spec('ocr_latent') is not None)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"


def test_every_setting_is_in_the_readme_table_and_every_row_is_a_setting():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([A-Z_]+)`", row)}
    read = {name for name in variables() if not name.startswith("OCR_LATENT_TEST_")}
    assert documented == read, (sorted(read - documented), sorted(documented - read))
