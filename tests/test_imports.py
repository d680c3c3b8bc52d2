"""The import map of dlrm/ and kernels/, read from the source with `ast` (nothing is imported): project
modules are imported at module top, the modules import each other without cycles, and no module imports
one of a higher layer (`LAYERS`)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PACKAGES = ("dlrm", "kernels")

# Lowest first. A module belongs to the layer of its longest matching prefix and may import modules of
# its own layer or lower ones only; the packages themselves (dlrm/__init__.py: the version and
# dlrm.ctrl_c) are the lowest. A new module outside every prefix fails `test_every_module_has_a_layer`:
# give it the layer of what it is built from.
LAYERS = (
    ("startup", ("dlrm.ctrl_c",)),  # what dlrm/__init__.py runs before a command's imports
    ("kernels", ("kernels",)),
    (
        "base",
        (
            "dlrm.atomic",
            "dlrm.choices",
            "dlrm.cli_options",
            "dlrm.config",
            "dlrm.config_sections",
            "dlrm.device",
            "dlrm.errors",
            "dlrm.lr_schedule",
            "dlrm.optim",
            "dlrm.profiling",
            "dlrm.progress",
            "dlrm.staging",
        ),
    ),
    ("data", ("dlrm.data", "dlrm.metrics")),
    ("model", ("dlrm.model",)),
    ("step", ("dlrm.step", "dlrm.graphs", "dlrm.scoring", "dlrm.out_of_memory")),
    ("parallel", ("dlrm.parallel", "dlrm.checkpoint", "dlrm.signals")),
    ("run", ("dlrm.run",)),
    (
        "commands",
        ("dlrm.train", "dlrm.evaluate", "dlrm.predict", "dlrm.finetune", "dlrm.export", "dlrm.aoti"),
    ),
)

# The function-local imports that stay, each for a reason of its own:
# - kernels.*, from dlrm/: a kernel module decorates its Triton kernels when imported, and Triton reads
#   TRITON_INTERPRET then. `python -m dlrm.train --use-triton` (and evaluate/predict --backend triton) on a
#   CPU switch the interpreter on after reading their config (dlrm.device.use_interpreter_on_cpu), so the
#   model imports a kernel where it first calls it.
# - dlrm.data.binary, from dlrm.data.preprocess: it imports torch (over a second), which a preprocess
#   without --binary never needs.
DEFERRED_PACKAGES = ("kernels",)
DEFERRED = {("dlrm.data.preprocess", "dlrm.data.binary")}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, ast.Module]:
    """Every module of PACKAGES by dotted name, parsed."""
    return {
        module_name(path): ast.parse(path.read_text(), str(path))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for each project import in `tree`. `from a.b
    import c` names module a.b.c when it is one, else a.b; relative imports are resolved from `name`."""
    is_package = name in PACKAGES or any(k.startswith(name + ".") for k in known)
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        in_function = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                while target not in known and "." in target:
                    target = target.rpartition(".")[0]
                found.append((target, node.lineno, in_function))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return found


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the project modules it imports (at its top or in its functions)."""
    known = set(modules)
    return {
        name: {target for target, _, _ in imports(name, tree, known) if target != name}
        for name, tree in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, in sorted order)."""
    done, path, on_path = set(), [], set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


def layer_of(name: str) -> int | None:
    """Index in LAYERS of the layer of module `name` (longest matching prefix), None outside them all."""
    if name in PACKAGES:
        return 0
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


MODULES = project_modules()
GRAPH = import_graph(MODULES)


def test_project_modules_are_imported_at_module_top():
    known = set(MODULES)
    local = sorted(
        {
            f"{name}:{line} imports {target} inside a function"
            for name, tree in MODULES.items()
            for target, line, in_function in imports(name, tree, known)
            if in_function
            and (name, target) not in DEFERRED
            and not (name.split(".")[0] == "dlrm" and target.split(".")[0] in DEFERRED_PACKAGES)
        }
    )
    assert not local, "\n".join(local)


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    missing = [name for name in MODULES if layer_of(name) is None]
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_import_from_a_higher_layer():
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(name) is not None and layer_of(target) is not None and layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import dlrm.config", [("dlrm.config", False)]),
        ("from dlrm.model import sparse", [("dlrm.model.sparse", False)]),
        ("from dlrm.model import DLRM", [("dlrm.model", False)]),
        ("from . import sparse", [("dlrm.model.sparse", False)]),
        ("from .sparse import SparseArch", [("dlrm.model.sparse", False)]),
        ("def f():\n    from kernels.embedding import x", [("kernels.embedding", True)]),
        ("class C:\n    def m(self):\n        import dlrm.config", [("dlrm.config", True)]),
        ("import torch\nfrom torch import nn", []),
    ],
)
def test_imports_are_read_as_written(source, expected):
    known = {"dlrm", "dlrm.config", "dlrm.model", "dlrm.model.sparse", "dlrm.model.dlrm", "kernels.embedding"}
    found = imports("dlrm.model.dlrm", ast.parse(source), known)
    assert [(target, in_function) for target, _, in_function in found] == expected


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = {"d"}
    assert find_cycle(graph) is None
