"""One spawn of 2 gloo ranks for the release tests whose default process group is the world of
2 (tests/test_memory_release.py, test_release_table.py, test_release_trainers_ddp.py,
test_release_lightning_ddp.py): the processes start and import torch once for all of them (a
session fixture: each names this module in its pytest_plugins)."""
import time

import pytest

from test_distributed import _spawn


def _body(rank, out_dir):
    import test_memory_release
    import test_release_table
    out = {"memory": test_memory_release._memory_cases(rank)}
    t = time.perf_counter()
    out["table"] = test_release_table._table_cases(rank)
    out["table_seconds"] = time.perf_counter() - t
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        out["trainers"] = None
    else:
        import test_release_trainers_ddp
        out["trainers"] = test_release_trainers_ddp._trainer_cases(rank, out_dir)
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        out["lightning"] = None
    else:
        import test_release_lightning_ddp
        out["lightning"] = test_release_lightning_ddp._lightning_cases(rank, out_dir)
    return out


@pytest.fixture(scope="session")
def release_world2(tmp_path_factory):
    """What each of the 2 ranks returned."""
    return _spawn(_body, tmp_path_factory.mktemp("release_world2"), 2)
