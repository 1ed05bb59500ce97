"""Helpers for the tests that run the examples of docs/integrations.md in process."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example(name):
    """examples/<name>.py loaded as a module (its main(argv) runs it as the command line does)."""
    spec = importlib.util.spec_from_file_location("example_" + name,
                                                  os.path.join(ROOT, "examples", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_run(resumed, full, precision):
    """The results of a resumed run equal those of the run without a break. A dynamic (FP16)
    scale's state_dict is torch's, which has no skip counter: the resumed run counts its own
    skips only."""
    if precision == "fp16":
        resumed, full = dict(resumed), dict(full)
        del resumed["skipped_steps"], full["skipped_steps"]
    return resumed == full
