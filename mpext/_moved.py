"""The import paths of modules that moved into packages (issue 43: mpext/amp, mpext/integrations,
mpext/memory), kept working: ``import mpext.grad_scaler`` gives the module
``mpext.amp.grad_scaler`` itself (the same object, so classes, pickles and ``isinstance``
agree). No file is left at an old path, so a change made to a module at its old path on
another branch follows the move in a merge. mpext's own code imports the new paths
(tests/test_layout.py)."""
import importlib
import importlib.abc
import importlib.util
import sys

# old name -> the module it now is
MOVED = {
    "mpext.grad_scaler": "mpext.amp.grad_scaler",
    "mpext.mixed_precision": "mpext.amp.mixed_precision",
    "mpext.lightning": "mpext.integrations.lightning",
    "mpext.accelerate": "mpext.integrations.accelerate",
    "mpext.checkpoint": "mpext.integrations.checkpoint",
    "mpext.dcp": "mpext.integrations.dcp",
    "mpext.memory_estimate": "mpext.memory.estimator",
    "mpext.memory_measure": "mpext.memory.meter",
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module it now is. The import system keeps what
    ``exec_module`` leaves in ``sys.modules`` under the old name, so the new module is returned
    as it is (its own ``__name__`` and ``__spec__`` untouched); an ImportError of the new module
    (a framework not installed) propagates unchanged."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    """Puts the finder on ``sys.meta_path`` once (re-importing mpext adds no second one)."""
    if not any(type(f).__name__ == "_Finder" and type(f).__module__ == __name__
               for f in sys.meta_path):
        sys.meta_path.append(_Finder())
