"""The torch requirement in mpext's metadata: a range in the sdist, a pin in anything built.

mpext._C is compiled against torch's C++ API, which has no stable ABI from one release to the
next, so a wheel (or an install built from the sdist) loads only with the torch release it was
built against, and its metadata says so. The sdist is compiled by whoever installs it, against
the torch they have, so it keeps the range of releases mpext supports.

The local version label is dropped from the pin: torch 2.13.0+cpu is pinned as torch==2.13.0.
PEP 440 ignores a candidate's local label when the specifier has none, so the pin accepts
2.13.0+cpu, 2.13.0+cu130 and the unlabelled 2.13.0 that the default index serves, whose
distribution version has no label even where torch.__version__ reports one (2.13.0+cu130).
Pinning the label would make pip reject that torch and try to replace it with a build no index
has. What the pin cannot say is CPU versus CUDA: a wheel built with CUDA kernels fails to load
under a CPU-only torch of the same release, and `import mpext` says so (mpext.build_info()
records which was built).
"""

TORCH_RANGE = "torch>=2.4"


def built_against(torch_version):
    """The requirement of something built against this torch: torch==<its public version>."""
    public = str(torch_version).split("+", 1)[0]
    if not public:
        raise ValueError("not a torch version: %r" % (torch_version,))
    return "torch==" + public


def torch_requirement(commands, torch_version):
    """What setup.py declares for the setup commands it runs: the range when it makes an sdist,
    the pin for everything else (wheel, metadata for a wheel, editable and in-place builds)."""
    return TORCH_RANGE if "sdist" in commands else built_against(torch_version)
