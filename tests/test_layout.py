"""The Python package's layering (docs/contributing.md, "Python optimizer package"): no module
of mpext imports, at import time, a module that imports it back, so any module can be imported
first; and mpext.amp.mixed_precision reaches into mpext.optim only through the internals the
package shares for it. Nothing in mpext or tests imports benchmarks/. Between the packages by
job (mpext.optim, amp, integrations, memory) imports go one way, optim below amp and
integrations, and mpext imports no moved module by its old path."""
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mpext"
# What mpext.optim's modules share with mpext.amp.mixed_precision (named in their docstrings).
SHARED = {"mpext.optim._engine": {"StepItem"},
          "mpext.optim._state": {"new_moments", "conform_state"},
          "mpext.optim._base": {"FusedOptimizer", "ema_swapped"}}


def modules():
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def top_level_imports(name, path, mods):
    """The mpext modules ``name`` imports when it is imported (functions' imports run later
    and are left out). ``from . import sub`` needs the submodule only: its package is the one
    being imported."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.ImportFrom):
                base = (".".join(package[:len(package) - node.level + 1]
                                 + ([node.module] if node.module else []))
                        if node.level else node.module)
                subs = {base + "." + a.name for a in node.names} & set(mods)
                found.update(subs if len(subs) == len(node.names) else subs | {base})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            for field in ("body", "orelse", "handlers", "finalbody"):
                if isinstance(getattr(node, field, None), list):
                    visit(getattr(node, field))

    visit(ast.parse(path.read_text()).body)
    return (found & set(mods)) - {name}


def test_no_import_cycles():
    mods = modules()
    graph = {m: top_level_imports(m, p, mods) for m, p in mods.items()}
    assert "mpext.optim._base" in graph["mpext.optim.adam"]  # the walk sees relative imports

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for n in graph[m]:
                if n == goal:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert cycles == [], "modules importing each other: %s" % cycles


def test_mixed_precision_uses_only_what_optim_shares():
    tree = ast.parse((PKG / "amp" / "mixed_precision.py").read_text())
    aliases = {}  # local name -> mpext.optim module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module \
                and node.module.startswith("optim"):
            module = "mpext." + node.module
            for a in node.names:
                if module + "." + a.name in SHARED:
                    aliases[a.asname or a.name] = module + "." + a.name
                else:
                    assert a.name in SHARED.get(module, ()), (module, a.name)
    assert set(aliases.values()) == {"mpext.optim._engine", "mpext.optim._state"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                assert node.attr in SHARED[aliases[node.value.id]], (node.value.id, node.attr)
            if node.value.id == "_mp_optim":  # the package itself: public names only
                assert not node.attr.startswith("_"), node.attr


def test_nothing_imports_the_benchmarks():
    """benchmarks/ is a leaf: no test and no module of mpext imports it (a test's model lives in
    tests/, e.g. small_gpt.py), anywhere in the file, functions included."""
    users = []
    for path in sorted(list(PKG.rglob("*.py")) + list((ROOT / "tests").rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                users.append("%s:%d" % (path.relative_to(ROOT), node.lineno))
    assert users == [], "imports of benchmarks/: %s" % users


# ---- Packages by job (issue 43): mpext.optim, mpext.amp, mpext.integrations, mpext.memory ----

PACKAGES = ("mpext.optim", "mpext.amp", "mpext.integrations", "mpext.memory")
# Imports that break a rule below until the module's owner changes them, each with the change
# that ends it (this set only shrinks: the test fails for any other breach).
PENDING = {
    # an isinstance check of the release's scaler: duck-typing on the scaler's public
    # record_released_step ends it (mpext.optim never names the amp package)
    ("mpext.optim._release", "mpext.grad_scaler"),
}


def all_imports(name, path, known):
    """(module, line) of every mpext module ``name`` imports anywhere in its source, functions
    included; ``known``: the importable names (files and the moved modules' old paths)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (".".join(package[:len(package) - node.level + 1]
                             + ([node.module] if node.module else []))
                    if node.level else node.module)
            subs = {base + "." + a.name for a in node.names} & known
            out.update((m, node.lineno) for m in (subs if subs else {base}))
        elif isinstance(node, ast.Import):
            out.update((a.name, node.lineno) for a in node.names)
    return {(m, line) for m, line in out if m == "mpext" or m.startswith("mpext.")}


def _moved():
    from mpext._moved import MOVED
    assert {"mpext.grad_scaler", "mpext.lightning", "mpext.memory_estimate"} <= set(MOVED)
    return MOVED


@functools.lru_cache(maxsize=None)
def _import_table():
    mods, moved = modules(), _moved()
    known = set(mods) | set(moved)
    return {m: all_imports(m, p, known) for m, p in mods.items()}, moved


def _unit(module):
    """The package of PACKAGES a module belongs to, or the module itself."""
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), module)


def test_optim_never_imports_amp_or_integrations():
    """mpext.optim is below mpext.amp and mpext.integrations: none of its modules imports
    them, by their paths or their modules' old ones, anywhere in its source."""
    table, moved = _import_table()
    found = set()
    for m, imports in table.items():
        if _unit(m) != "mpext.optim":
            continue
        for target, line in imports:
            if _unit(moved.get(target, target)) in ("mpext.amp", "mpext.integrations"):
                found.add((m, target))
    assert found - PENDING == set(), "mpext.optim imports amp/integrations: %s" % sorted(found)


def test_no_import_circles_between_packages():
    """Between the packages (and the top-level modules), imports go one way, counting every
    import in a module's source, functions included, and an old path as the module it is now.
    The root package (mpext/__init__.py, the facade) is left out: it imports them all."""
    table, moved = _import_table()
    graph = {}
    for m, imports in table.items():
        if m == "mpext":
            continue
        for target, _ in imports:
            if (m, target) not in PENDING and target != "mpext":
                graph.setdefault(_unit(m), set()).add(_unit(moved.get(target, target)))
    graph = {u: deps - {u} for u, deps in graph.items()}
    assert "mpext.optim" in graph["mpext.amp"]  # the walk sees the packages' imports

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n == goal:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert cycles == [], "packages importing each other: %s" % cycles


def test_product_never_imports_the_old_paths():
    """mpext's own modules import the moved modules by their new paths; the old ones
    (mpext/_moved.py) are for users' code only."""
    table, moved = _import_table()
    found = sorted((m, target, line) for m, imports in table.items()
                   for target, line in imports if target in moved)
    assert [f for f in found if f[:2] not in PENDING] == [], \
        "imports of old paths: %s" % found
