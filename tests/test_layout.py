"""The Python package's layering (docs/contributing.md, "Python optimizer package"): no module
of mpext imports, at import time, a module that imports it back, so any module can be imported
first; and mpext.amp.mixed_precision reaches into mpext.optim only through the internals the
package shares for it. Nothing in mpext or tests imports benchmarks/."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mpext"
# What mpext.optim's modules share with mpext.amp.mixed_precision (named in their docstrings).
SHARED = {"mpext.optim._engine": {"StepItem", "AdamHyper", "adam_hyper", "fused_adam_step"},
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
