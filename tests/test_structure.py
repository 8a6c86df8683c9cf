"""The shape of the code: one import namespace, no import cycle, floors that import only downwards, no
sys.path edits, no function over 120 lines outside tests, and every setting documented in README's
configuration table."""
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


# ----------------------------------------------------------------------------- floors
MODULES = {module_name(p) for p in PACKAGE}
MODEL = {"architecture", "checkpoint", "encoder", "decoder", "generation", "quantizer", "views"}
FLOORS = {**{m: 0 for m in MODEL}, "serving": 1, "training": 1, "server": 2, "train": 2, "client": 2}
FLOOR_NAMES = ("the model", "serving/ and training/", "the faces")
# package modules on no floor: the namespace's own __init__, and scripts that make data files
OFF_THE_FLOORS = {"ocr_latent", "ocr_latent.corpus.make_corpus", "ocr_latent.examples.make_examples",
                  "ocr_latent.examples.hostile"}
# what training/ may import of its sibling serving/: the model's own reading of its inputs, and the confidence
# model that training/confidence.py fits for the server to use
TRAINING_MAY_IMPORT = {"ocr_latent.serving.pipeline", "ocr_latent.serving.documents", "ocr_latent.serving.confidence"}
# Imports a rule forbids that stay, each with its reason (a test fails on any other, and on one gone).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# architecture.py: the contract's constants and the codes' wire format, torch-free, read by both ends of the wire
KNOWN_CLIENT = {("ocr_latent.client.codesfile", "ocr_latent.architecture")}


def module_level_imports(path: Path) -> set[str]:
    """What importing a module imports: its import statements outside function bodies (and outside
    `if TYPE_CHECKING:`), relative ones resolved; `from a import b` is a.b where that is a module of the
    package, else a."""
    name = module_name(path)
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def floor_of(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if parts[0] == "ocr_latent" and len(parts) > 1 else None


def test_every_module_of_the_package_is_on_a_floor():
    assert not {m for m in MODULES if floor_of(m) is None} - OFF_THE_FLOORS, sorted(MODULES)
    assert OFF_THE_FLOORS <= MODULES


def test_no_floor_imports_a_higher_one():
    """Floors, low to high: the model (architecture, checkpoint, encoder, decoder, generation, quantizer);
    serving/ and training/, siblings; the faces (server.py, train.py, client/). The rules, on what
    importing a module imports (its module-level imports):

    - no module imports a module of a higher floor;
    - serving/ imports nothing of training/ (a server runs without the training code); training/ imports
      of serving/ only the model's own reading of its inputs: serving.pipeline (the base's fingerprint a
      quantizer is signed with) and serving.documents (images and PDF pages as the server sees them);
      nothing of the engine, settings or HTTP.

    An import inside a function is lazy and not counted: e.g. serving/ray_serve.py builds server.py's app
    inside a function, client/cli.py imports server, train and serving/ inside the commands that need
    them, training/self_reading.py reads PDFs with serving.documents.
    """
    found = set()
    for p in PACKAGE:
        m = module_name(p)
        if floor_of(m) is None:
            continue
        for d in module_level_imports(p) & MODULES:
            if floor_of(d) is None:
                continue
            room, other = m.split(".")[1], d.split(".")[1]
            if floor_of(d) > floor_of(m) or (room, other) == ("serving", "training") or \
                    (room, other) == ("training", "serving") and d not in TRAINING_MAY_IMPORT:
                found.add((m, d))
    new = sorted(found - KNOWN_UPWARD)
    assert not new, "\n".join(f"{m} ({FLOOR_NAMES[floor_of(m)]}) imports {d} ({FLOOR_NAMES[floor_of(d)]})"
                              for m, d in new)
    assert not KNOWN_UPWARD - found, f"fixed: delete from KNOWN_UPWARD {sorted(KNOWN_UPWARD - found)}"


def test_the_client_imports_no_torch_and_of_the_package_only_itself():
    """client/ (the `ocr-latent` command, `Client`, the codes file) starts without torch and without the
    model, serving or training code: at module level it imports no torch and, of the package, only
    client/; the commands that serve, train or run bulk jobs import those inside functions (lazily, not
    counted). tests/test_client.py checks that importing it indeed loads no torch."""
    found = {(module_name(p), d) for p in PACKAGE if p.relative_to(ROOT).parts[0] == "client"
             for d in module_level_imports(p)
             if d.split(".")[0] == "torch" or d.startswith("ocr_latent.") and not d.startswith("ocr_latent.client")}
    assert not found - KNOWN_CLIENT, sorted(found - KNOWN_CLIENT)
    assert not KNOWN_CLIENT - found, f"fixed: delete from KNOWN_CLIENT {sorted(KNOWN_CLIENT - found)}"


def test_no_test_module_imports_another():
    """What the tests share (the server harness, free_port, helpers) is in tests/conftest.py."""
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    crossed = [(p.name, ast.unparse(n)) for p in (ROOT / "tests").glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.ImportFrom) and n.module in tests
               or isinstance(n, ast.Import) and {a.name for a in n.names} & tests]
    assert not crossed, crossed

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
