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


def _cycles(graph):
    """The edges (a, b) of graph (node -> set of nodes) from which a is reachable again."""
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

    return sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))


def test_no_import_cycles():
    mods = modules()
    graph = {m: top_level_imports(m, p, mods) for m, p in mods.items()}
    assert "mpext.optim._base" in graph["mpext.optim.adam"]  # the walk sees relative imports

    cycles = _cycles(graph)
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
PENDING = set()  # imports allowed to break the rules below for now: none


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

    cycles = _cycles(graph)
    assert cycles == [], "packages importing each other: %s" % cycles


def test_product_never_imports_the_old_paths():
    """mpext's own modules import the moved modules by their new paths; the old ones
    (mpext/_moved.py) are for users' code only."""
    table, moved = _import_table()
    found = sorted((m, target, line) for m, imports in table.items()
                   for target, line in imports if target in moved)
    assert [f for f in found if f[:2] not in PENDING] == [], \
        "imports of old paths: %s" % found

# ---------------------------------------------------------------------------------------------
# The native tree (docs/contributing.md, "The native tiers"): rules are listed once, as the rows
# of csrc/include/mpext/rules/rules.h; every tier's enum, dispatch, CUDA cases and op
# registrations are generated from them, so the engine's files name no rule.

NATIVE_DIRS = ("csrc", "cuda")
NATIVE_EXTS = {".c", ".h", ".cpp", ".cu", ".cuh"}
RULES_HEADER = ROOT / "csrc" / "include" / "mpext" / "rules" / "rules.h"
# Where a rule may be named: its own files (the C rule headers and the C++ op entries), and the
# fast paths, a cache kept for particular rules and formats (csrc/core/fast/README.md).
RULE_DIRS = ("csrc/include/mpext/rules/", "csrc/torch/rules/", "csrc/core/fast/")
# The step engine, every tier: what steps any rule.
ENGINE_FILES = ("csrc/include/mpext/step.h", "csrc/include/mpext/step_storage.h",
                "csrc/include/mpext/step_common.h", "csrc/include/mpext/step_cuda.h",
                "csrc/core/step.c", "csrc/core/cpu.c", "csrc/core/isa.h", "csrc/core/table.c",
                "csrc/core/formats/tiles.h", "csrc/include/mpext/formats/formats.h",
                "csrc/include/mpext/formats/q8.h", "cuda/step.cu", "csrc/torch/step_common.h",
                "csrc/torch/step_common.cpp", "csrc/torch/step.cpp", "csrc/torch/step_cuda.cpp")
# The names of the step before the rename, kept as aliases for one release (mpext/adam.h).
ALIASES = {"mp_adam_tensor", "mp_adam_options", "mp_adam_step", "mp_adam_advance_steps",
           "mp_adam_step_multi_cuda"}


def _native_files():
    for d in NATIVE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in NATIVE_EXTS:
                yield path.relative_to(ROOT).as_posix(), path


def _code_only(text):
    """C/C++ source without its comments and string literals (what the compiler reads as
    names)."""
    import re
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                         re.S)
    return pattern.sub(lambda m: " " if m.group(0).startswith("/") else '""', text)


def _rule_rows():
    """(ID, name) of every row of MP_RULES."""
    import re
    text = RULES_HEADER.read_text()
    block = re.search(r"#define MP_RULES\(X\)(.*?)\n\n", text, re.S).group(1)
    return re.findall(r"X\((\w+),\s*(\w+),", block)


def test_rules_are_listed_once():
    """The rows name at least the rules the ops register (so the checks below see them)."""
    names = {name for _, name in _rule_rows()}
    assert {"adam", "lion", "sgd"} <= names, names


def test_no_native_file_outside_the_rules_names_a_rule_id():
    """MP_RULE_<ID> appears only in the rules' own files (and the fast paths' index); every
    other site is generated from the rows (MP_RULE_##ID) or uses MP_RULE_COUNT."""
    import re
    ids = {i for i, _ in _rule_rows()}
    found = []
    for rel, path in _native_files():
        if rel.startswith(RULE_DIRS):
            continue
        for m in re.finditer(r"\bMP_RULE_([A-Z0-9_]+)\b", _code_only(path.read_text())):
            if m.group(1) in ids:
                found.append("%s: %s" % (rel, m.group(0)))
    assert found == [], "rule ids named outside the rules' files: %s" % found


def test_the_engine_names_no_rule():
    """No name in the engine's files (comments and strings aside) has a rule's name as one of
    its words (mp_adam_element, lion_tile, SgdRule, ...), but the one-release aliases."""
    import re
    names = {name.lower() for _, name in _rule_rows()}
    found = []
    for rel in ENGINE_FILES:
        code = _code_only((ROOT / rel).read_text())
        for word in sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", code)) - ALIASES):
            parts = {p.lower() for p in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", word)}
            if parts & names:
                found.append("%s: %s" % (rel, word))
    assert found == [], "the engine names a rule: %s" % found
# ---- Rules are found, not listed: a rule is named by its row, nowhere in a list ------------
# (docs/adding_a_rule.md). The C++ ops' entry headers are included from a list build_tools/rules.py
# writes from the rows; mpext.optim re-exports each rule's class module found by the rows' names
# (mpext._C lists them); mpext.ops registers one fake for every row's op.

# The files that found rules by a list of them; every module of mpext is scanned for lists of
# the rules' ops or names (a dict, list, set or tuple naming two or more rules).
LISTING_FILES = ("mpext/optim/__init__.py", "mpext/ops.py", "mpext/__init__.py")
# Lists allowed for now: telemetry's moment-list count per op (mpext/telemetry/_step.py's
# _MOMENT_LISTS), which each op's schema gives (the index of "masters" less 2).
PENDING_LISTS = set()


def _rule_words():
    """The rules' names as the rows give them, and the modules they are found in (the names'
    first words: muon_momentum, muon_update -> muon)."""
    names = {name for _, name in _rule_rows()}
    return names | {name.split("_")[0] for name in names}


def rule_listing(rel, text, words, classes):
    """Where a source lists rules by hand, as "file:line: what": a native file including two or
    more rules' headers; a Python display (dict, list, set, tuple; not ``__all__``) naming the
    ops of two or more rules; and in LISTING_FILES, the files that find the rules, a display of
    two or more rules' names or classes, any of them as a string, an import of a rule's class
    module or class, a registration of a rule's op. ``words``: the rows' names and their
    modules; ``classes``: the rules' public names, each to its module."""
    import re
    found = []
    if not rel.endswith(".py"):
        headers = re.findall(r'^\s*#\s*include\s+"(?:[^"]*/)?rules/(\w+)\.h"', text, re.M)
        headers += [h for h in re.findall(r'^\s*#\s*include\s+"(\w+)\.h"', text, re.M)
                    if rel.startswith(RULE_DIRS)]
        listed = sorted(set(headers) & words)
        if len(listed) >= 2:
            found.append("%s: includes the rules %s" % (rel, ", ".join(listed)))
        return found
    tree = ast.parse(text)
    docs = _docstrings(tree)
    exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
               and "__all__" in {getattr(t, "id", None) for t in getattr(n, "targets", [])
                                 + [getattr(n, "target", None)]}}
    listing = rel in LISTING_FILES
    for node in ast.walk(tree):
        if isinstance(node, (ast.Dict, ast.List, ast.Set, ast.Tuple)) and id(node) not in exports:
            # the rules a display names: by their ops anywhere, by their names or classes in
            # the files that find the rules (counted by rule: Muon's two ops are one rule)
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            strings = {k.value for k in items
                       if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            named = {v[:-len("_step_")] for v in strings if v.endswith("_step_")} & words
            if listing:
                named |= strings & (words | set(classes))
            rules = {classes[n] if n in classes else n.split("_")[0] for n in named}
            if len(rules) >= 2:
                found.append("%s:%d: lists the rules %s" % (rel, node.lineno, sorted(named)))
        if not listing:
            continue
        if isinstance(node, ast.ImportFrom):
            mods = {(node.module or "").split(".")[-1]} | {a.name for a in node.names}
            rules = sorted(mods & (words | set(classes)))
            if rules:
                found.append("%s:%d: imports %s" % (rel, node.lineno, ", ".join(rules)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and node.value in words | set(classes):
            found.append("%s:%d: names the rule %r" % (rel, node.lineno, node.value))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) in ("register_fake", "register_kernel", "impl"):
            for arg in node.args[:1]:  # a registration of one rule's op (its wrapper may name it)
                ops = set(re.findall(r"\b(\w+)_step_\b", getattr(arg, "value", "") or ""))
                if isinstance(getattr(arg, "value", None), str) and ops & words:
                    found.append("%s:%d: registers the op of %s" % (rel, node.lineno,
                                                                    sorted(ops & words)))
    return found


def _rule_classes():
    """The public names of the rules' class modules, each to its module's name."""
    import importlib
    import mpext.optim  # noqa: F401
    return {c: w for w in _rule_words() if importlib.util.find_spec("mpext.optim." + w)
            for c in importlib.import_module("mpext.optim." + w).__all__}


def test_rules_are_found_not_listed():
    """No file lists the rules outside the rows: csrc/torch/rules/ holds entries only (the list
    of them is generated: no rules.h), no native file includes several rules' headers but the
    rows' own, and mpext.optim, mpext.ops and mpext name no rule's module, class or op."""
    words, classes = _rule_words(), _rule_classes()
    assert not (ROOT / "csrc" / "torch" / "rules" / "rules.h").exists(), \
        "csrc/torch/rules/rules.h lists the rules' entries; the build writes that list"
    found = []
    for rel, path in _native_files():
        if path != RULES_HEADER:
            found += rule_listing(rel, path.read_text(), words, classes)
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        hits = rule_listing(rel, path.read_text(), words, classes)
        assert rel not in PENDING_LISTS or hits, "%s lists no rule now: leave PENDING" % rel
        found += [] if rel in PENDING_LISTS else hits
    assert found == [], "rules listed by hand:\n" + "\n".join(found)


def test_the_rule_listing_scan_finds_what_it_looks_for():
    """The scan above on what each listing looked like (each must be found), and on the rows'
    header, which lists every rule's C header (and so is the one file allowed to)."""
    words, classes = _rule_words(), _rule_classes()
    a, b = [name for _, name in _rule_rows()][:2]  # two rules, whichever the rows hold
    cls = next(c for c, w in classes.items() if w == b)
    assert {"Adam", "AdamW"} <= set(classes), classes
    bad = {"csrc/torch/rules/rules.h": '#pragma once\n#include "%s.h"\n#include "%s.h"\n' % (a, b),
           "csrc/torch/step.cpp": '#include "rules/%s.h"\n#include "rules/%s.h"\n' % (a, b),
           "mpext/optim/__init__.py": "from .%s import %s\n" % (b, cls),
           "mpext/memory/_x.py": "RULES = ('%s_step_', '%s_step_')\n" % (a, b),
           "mpext/__init__.py": "RULES = ['%s', '%s']\n" % (a, b),
           "mpext/telemetry/_x.py": "N = {'%s_step_': 2, '%s_step_': 1}\n" % (a, b),
           "mpext/ops.py": '@torch.library.register_fake("mpext::%s_step_")\ndef f(): pass\n' % b}
    for rel, text in bad.items():
        assert rule_listing(rel, text, words, classes), "the scan missed %s" % rel
    rows = RULES_HEADER.relative_to(ROOT).as_posix()
    assert len(rule_listing(rows, RULES_HEADER.read_text(), words, classes)) == 1
    ok = ('"""%s_step_ in prose"""\n_prepare_step("%s_step_", params)\n'
          '__all__ += ["%s_step_", "%s_step_"]\n' % (a, b, a, b))
    assert rule_listing("mpext/ops.py", ok, words, classes) == []


def test_build_info_lists_the_rows():
    """mpext._C's rule names (what mpext.optim and mpext.ops find the rules by) are the rows',
    compiled into it, in order; each is an op and its classes are mpext.optim's."""
    import mpext
    import torch
    names = [name for _, name in _rule_rows()]
    assert mpext.build_info()["rules"] == names
    for name in names:
        assert hasattr(torch.ops.mpext, name + "_step_"), name
    import mpext.optim
    classes = _rule_classes()
    assert set(classes) <= set(mpext.optim.__all__)
    assert all(getattr(mpext.optim, c).__module__ == "mpext.optim." + w
               for c, w in classes.items())


# ---- Formats are objects: nothing outside mpext/optim/formats.py asks which one it holds ------

FORMATS_PY = PKG / "optim" / "formats.py"


def _docstrings(tree):
    """The ids of the docstring constants of a module, its classes and functions (prose, where a
    format may be named)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def format_naming(path, tree):
    """Where the code of ``path`` names a particular state format (mpext.optim.formats): a
    format object read from the formats module (``F.Q8``, ``formats.BF16``, ``from .formats
    import MASTER``), a format's state key or key suffix in a string (``"_q8"``,
    ``"master_param"``), a test of a code dtype (``t.dtype in (torch.int8, torch.uint8)``:
    int8 meaning the 8-bit code, int16 a remainder) or a Q8 name (``Q8_BLOCK_MIN``), as
    "file:line: what"."""
    import torch
    from mpext.optim import formats as F
    objects = {n for n, v in vars(F).items() if isinstance(v, (F.MomentFormat, F.ParamFormat))}
    keys = {f.key for f in F.PARAM_FORMATS.values() if f.key is not None}
    suffixes = {"_" + f.code for f in F.MOMENT_FORMATS.values() if f.code is not None}
    codes = {str(d).replace("torch.", "") for d in (torch.int8, torch.uint8, torch.int16)}
    in_optim = PKG / "optim" in path.parents
    docs = _docstrings(tree)
    aliases = set()  # local names of the formats module
    found = []

    def hit(node, what):
        found.append("%s:%d: %s" % (path.relative_to(ROOT), node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            for a in node.names:
                if a.name == "formats":
                    aliases.add(a.asname or a.name)
                elif mod.split(".")[-1] == "formats" and a.name in objects:
                    hit(node, "imports the format object %s" % a.name)
                elif in_optim and "Q8" in a.name:
                    hit(node, "imports %s" % a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr in objects:
            hit(node, "names the format object %s.%s" % (node.value.id, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs:
            if node.value in keys or any(s in node.value for s in suffixes):
                hit(node, "names a format's state key in %r" % node.value)
        elif in_optim and isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and sub.attr in codes:
                    hit(node, "tests a code dtype (torch.%s)" % sub.attr)
        if in_optim and "Q8" in (getattr(node, "id", None) or getattr(node, "attr", None)
                                 or ""):
            hit(node, "names %s" % (getattr(node, "id", None) or node.attr))
    return found


def test_no_code_outside_the_formats_names_a_format():
    """docs/lean_state.md, "Format objects": the optimizer, its state code, the engine and the
    shard exchange call the format objects' behaviour and never ask which format they hold, so
    that a new format is its object, its C codec and a table row. (The check itself is checked:
    the same scan finds the formats module's own names.)"""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path != FORMATS_PY:
            found += format_naming(path, ast.parse(path.read_text()))
    assert found == [], "code outside mpext/optim/formats.py naming formats:\n" + "\n".join(found)


def test_the_format_scan_finds_what_it_looks_for():
    """The scan of the test above, on snippets that do each thing it forbids (each must be
    found) and on the formats module itself (which names them all)."""
    bad = {
        "from . import formats as F\nx = F.Q8\n": "F.Q8",
        "from .formats import BF16\n": "BF16",
        "from . import formats\nx = formats.REMAINDER\n": "formats.REMAINDER",
        "k = name + '_q8'\n": "'_q8'",
        "s = state.get('master_param')\n": "'master_param'",
        "import torch\nc = t.dtype in (torch.int8, torch.uint8)\n": "torch.int8",
        "import torch\nr = t.dtype is torch.int16\n": "torch.int16",
        "from .._common import Q8_BLOCK_MIN\n": "Q8_BLOCK_MIN",
    }
    fake = PKG / "optim" / "_scan_probe.py"
    for src, what in bad.items():
        assert format_naming(fake, ast.parse(src)), "the scan missed %s" % what
    clean = '"""Docstrings may name exp_avg_q8 and master_param."""\nx = fmt.keys(q)\n'
    assert format_naming(fake, ast.parse(clean)) == []
    assert len(format_naming(FORMATS_PY, ast.parse(FORMATS_PY.read_text()))) > 10
