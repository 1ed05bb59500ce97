"""The torch requirement setup.py writes into mpext's metadata (build_tools/requirements.py),
checked with PEP 440 matching as pip does it (packaging). Building and installing the sdist and
the wheel is .ci/package_check's job."""
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from build_tools import requirements  # noqa: E402


def accepts(requirement, version):
    req = Requirement(requirement)
    assert req.name == "torch"
    return req.specifier.contains(Version(version), prereleases=True)


@pytest.mark.parametrize("built", ["2.13.0+cpu", "2.13.0+cu130", "2.13.0", "2.4.1+rocm6.1"])
def test_pin_is_the_public_release(built):
    """Built against torch X+label: requires torch==X, which every build of release X satisfies
    (CPU, CUDA, the unlabelled one an index serves) and no other release does."""
    pin = requirements.built_against(built)
    public = built.split("+")[0]
    assert pin == "torch==" + public
    for same in (public, public + "+cpu", public + "+cu130", public + "+cu126"):
        assert accepts(pin, same), (pin, same)
    major, minor, patch = (int(p) for p in public.split("."))
    for other in ("%d.%d.%d" % (major, minor, patch + 1), "%d.%d.%d+cpu" % (major, minor + 1, 0),
                  "%d.%d.%d" % (major, minor - 1, patch), "%s.post1" % public,
                  "%s.dev20250101" % public, "%src1" % public):
        assert not accepts(pin, other), (pin, other)


def test_pin_of_a_prerelease_torch():
    """A nightly is pinned to itself, not to the release it precedes."""
    pin = requirements.built_against("2.14.0.dev20250601+cu130")
    assert pin == "torch==2.14.0.dev20250601"
    assert accepts(pin, "2.14.0.dev20250601+cpu")
    assert not accepts(pin, "2.14.0") and not accepts(pin, "2.14.0.dev20250602")


def test_pin_of_the_running_torch():
    """The torch this suite runs on: its pin accepts it, and so does the sdist's range."""
    assert accepts(requirements.built_against(torch.__version__), str(torch.__version__))
    assert accepts(requirements.TORCH_RANGE, str(torch.__version__))


@pytest.mark.parametrize("argv,sdist", [
    # what setuptools.build_meta runs for each PEP 517 hook, and the direct setup.py commands
    (["sdist", "--formats", "gztar", "--dist-dir", "/tmp/d"], True),
    (["egg_info", "sdist"], True),
    (["bdist_wheel", "--dist-dir", "/tmp/d"], False),
    (["dist_info", "--output-dir", "/tmp/d", "--keep-egg-info"], False),
    (["editable_wheel", "--dist-dir", "/tmp/d"], False),
    (["egg_info"], False),
    (["-q", "build_ext", "--inplace"], False),
])
def test_range_in_the_sdist_pin_in_anything_built(argv, sdist):
    got = requirements.torch_requirement(argv, "2.13.0+cpu")
    assert got == (requirements.TORCH_RANGE if sdist else "torch==2.13.0")


def test_not_a_version():
    with pytest.raises(ValueError, match="not a torch version"):
        requirements.built_against("+cpu")


def test_every_python_package_is_packaged():
    """pyproject.toml's package discovery (what the sdist and the wheel take) finds every folder
    of Python modules under mpext/ -- the packages by job (optim, amp, integrations, memory)
    included -- as the filesystem has them."""
    import tomllib

    from setuptools import find_packages
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(where=str(root), include=find["include"],
                              exclude=find.get("exclude", ())))
    on_disk = {".".join(d.relative_to(root).parts) for d in (root / "mpext").rglob("*")
               if d.is_dir() and any(d.glob("*.py"))} | {"mpext"}
    assert {"mpext.optim", "mpext.amp", "mpext.integrations", "mpext.memory"} <= on_disk
    assert found == on_disk
