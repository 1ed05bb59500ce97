"""The modules that moved into packages (issue 43) keep their old import paths: each old path
imports as the very module at its new path, so every object it gives is the same object (a
class, an exception, a function), a pickle naming the old path loads, and the top-level names
are unchanged. The table is written here, not read from mpext/_moved.py, so a wrong or missing
alias there fails."""
import importlib
import pickle
import subprocess
import sys

import pytest

import mpext

OLD_TO_NEW = {
    "mpext.grad_scaler": "mpext.amp.grad_scaler",
    "mpext.mixed_precision": "mpext.amp.mixed_precision",
    "mpext.lightning": "mpext.integrations.lightning",
    "mpext.accelerate": "mpext.integrations.accelerate",
    "mpext.checkpoint": "mpext.integrations.checkpoint",
    "mpext.dcp": "mpext.integrations.dcp",
    "mpext.memory_estimate": "mpext.memory.estimator",
    "mpext.memory_measure": "mpext.memory.meter",
}
# What the old modules' users reached through them (their public names, and the private ones
# mpext's own modules imported from each other before the move).
NAMES = {
    "mpext.grad_scaler": ["GradScaler"],
    "mpext.mixed_precision": ["MixedPrecisionOptimizer", "_make_scaler"],
    "mpext.lightning": ["MixedPrecision"],
    "mpext.accelerate": ["use_grad_scaler", "setup_trainer"],
    "mpext.checkpoint": ["CheckpointError"],
    "mpext.dcp": ["LoadPlanner", "format_entries"],
    "mpext.memory_estimate": ["estimate", "MODES", "FORMAT_MODES", "ALIASES", "RULES",
                              "OPTIMIZERS", "MODELS", "ModeSpec", "ModelSpec", "Breakdown",
                              "activation_bytes", "activation_formula", "fsdp2_shard",
                              "zero_partition", "GpuBudget", "fit_changes", "DEFAULT_BUCKET_BYTES"],
    "mpext.memory_measure": ["measure", "HeapMeter"],
}
# The names the module mpext.memory (the calculator's command line, now the package) had.
MEMORY_NAMES = ["MODES", "FORMAT_MODES", "ALIASES", "RULES", "OPTIMIZERS", "MODELS", "ModeSpec",
                "ModelSpec", "Breakdown", "estimate", "SHARDINGS", "fsdp2_shard",
                "zero_partition", "stage_label", "optimizer_states", "rule_states",
                "format_mode", "format_mode_name", "activation_bytes", "activation_formula",
                "activation_compression", "gpt_params", "gpt_shapes", "llama_params",
                "llama_shapes", "measure", "model_names", "model_spec", "mode_supports",
                "FAMILIES", "GpuBudget", "fit_changes", "gpu_memory_bytes", "verdict_lines",
                "main", "format_table", "build_parser", "plot", "ROWS", "DEVICES",
                "ATTENTIONS", "CUDA_CONTEXT_BYTES", "ALLOCATOR_SLACK", "DEFAULT_BUCKET_BYTES"]


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_old_path_is_the_new_module(old):
    new = importlib.import_module(OLD_TO_NEW[old])
    mod = importlib.import_module(old)
    assert mod is new and sys.modules[old] is new
    assert new.__name__ == OLD_TO_NEW[old]  # the module keeps its own name and spec
    assert new.__spec__.name == OLD_TO_NEW[old]
    parent, _, child = old.rpartition(".")
    assert getattr(sys.modules[parent], child) is new  # mpext.grad_scaler as an attribute
    for name in NAMES[old]:
        assert getattr(mod, name) is getattr(new, name), (old, name)
    # the statement forms users write
    got = {}
    exec("from %s import %s as x" % (parent, child), got)
    assert got["x"] is new
    exec("import %s as y" % old, got)
    assert got["y"] is new


def test_memory_package_has_the_calculators_names():
    """mpext.memory was the calculator's module; as a package it has the same names, the
    same objects as the modules that now hold them."""
    import mpext.memory as memory
    from mpext.memory import cli, estimator, meter
    for name in MEMORY_NAMES:
        assert getattr(memory, name) is getattr(cli, name), name
    assert memory.estimate is estimator.estimate and memory.measure is meter.measure
    assert callable(memory.estimate) and callable(memory.measure)  # functions, not modules


def test_top_level_names_unchanged():
    from mpext.amp import GradScaler, MixedPrecisionOptimizer
    assert mpext.GradScaler is GradScaler and mpext.MixedPrecisionOptimizer is \
        MixedPrecisionOptimizer
    assert mpext.amp.grad_scaler.GradScaler is GradScaler


def test_pickles_naming_the_old_paths_load():
    """A GradScaler pickled before the move names mpext.grad_scaler; it loads as the class."""
    s = mpext.GradScaler("cpu", init_scale=2.0 ** 7, hysteresis=2)
    blob = pickle.dumps(s, protocol=2)  # names the class as text: "c<module>\n<name>\n"
    assert b"cmpext.amp.grad_scaler\nGradScaler\n" in blob
    old = blob.replace(b"cmpext.amp.grad_scaler\n", b"cmpext.grad_scaler\n")
    assert old != blob and b"mpext.amp" not in old
    back = pickle.loads(old)
    assert type(back) is mpext.GradScaler
    assert back.state_dict() == s.state_dict()


def test_unknown_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mpext.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mpext.grad_scaler.no_such_module")


def test_old_paths_without_the_framework_raise_its_hint():
    """The old paths of the framework integrations raise the modules' own ImportError where the
    framework is missing (blocked here), and ``import mpext`` imports no framework."""
    code = ("import sys\n"
            "for blocked in ('lightning', 'accelerate'):\n"
            "    sys.modules[blocked] = None\n"
            "import mpext\n"
            "assert 'lightning' not in sys.modules or sys.modules['lightning'] is None\n"
            "for old, hint in (('mpext.lightning', 'pip install lightning'),\n"
            "                  ('mpext.accelerate', 'pip install accelerate')):\n"
            "    try:\n"
            "        __import__(old)\n"
            "    except ImportError as exc:\n"
            "        assert hint in str(exc), (old, str(exc))\n"
            "    else:\n"
            "        raise AssertionError(old + ' imported without its framework')\n"
            "    assert old not in sys.modules, old\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

