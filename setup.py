"""Builds mpext._C against the installed PyTorch.

Install PyTorch first, then: pip install --no-build-isolation -e .

- The C core (csrc/core) is compiled as C11 by the C compiler, once per CPU ISA path (see
  build_tools/core.py), archived into a static library and linked into the extension.
- CUDA (cuda/*.cu, csrc/torch/*_cuda.cpp) is built when torch has CUDA (torch.version.cuda) and
  nvcc is found (CUDA_HOME), whether or not a GPU is visible. MPEXT_FORCE_CUDA=1 makes a missing
  toolkit an error; MPEXT_FORCE_CUDA=0 skips CUDA. With no visible GPU and TORCH_CUDA_ARCH_LIST
  unset, the archs default to Ampere and Hopper (8.0;9.0+PTX).
- Every unit is compiled at -O3; MPEXT_OPT_LEVEL=0 (or 1, 2, s, g) builds at that level instead
  (.ci/package_check's wheel: it checks packaging, not speed).
- The torch requirement is the range of supported releases in an sdist and a pin to the torch it
  was built against in a wheel or an install (build_tools/requirements.py says why).
"""
import glob
import os
import sys
import sysconfig

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_tools import core, requirements, rules  # noqa: E402

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:  # pragma: no cover - build-time message
    raise SystemExit(
        "mpext builds against the installed PyTorch, and none was found. Install PyTorch first "
        "(e.g. pip install torch), then build with: pip install --no-build-isolation -e ."
    ) from exc

ROOT = core.ROOT
try:  # checked before anything is compiled (MPEXT_OPT_LEVEL, build_tools/core.py)
    EXTENSION_CFLAGS = core.extension_cflags()
except ValueError as exc:
    raise SystemExit("mpext: %s" % exc) from None


def find_cuda_home():
    """A CUDA toolkit root with both nvcc and the runtime headers. torch guesses CUDA_HOME from
    the nvcc on PATH, which points at the wrong root when that nvcc is a wrapper script (e.g.
    /usr/local/bin/nvcc -> /usr/local/cuda-13.0/bin/nvcc gives /usr/local)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if (root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))
                and os.path.exists(os.path.join(root, "bin", "nvcc"))):
            return root
    return None


def want_cuda():
    force = os.environ.get("MPEXT_FORCE_CUDA")
    if force == "0":
        return False
    home = find_cuda_home() if torch.version.cuda is not None else None
    if home is None:
        if force == "1":
            raise SystemExit(
                "MPEXT_FORCE_CUDA=1 but CUDA cannot be built: "
                + ("this torch has no CUDA (torch.version.cuda is None)"
                   if torch.version.cuda is None
                   else "no CUDA toolkit with nvcc and include/cuda_runtime.h was found "
                        "(set CUDA_HOME to its root)"))
        return False
    cpp_extension.CUDA_HOME = home  # what CUDAExtension and the nvcc invocation use
    os.environ["CUDA_HOME"] = home
    return True


WITH_CUDA = want_cuda()
if WITH_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    if not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
CUDA_ARCHS = os.environ.get("TORCH_CUDA_ARCH_LIST", "detected") if WITH_CUDA else ""


class BuildExt(cpp_extension.BuildExtension):
    """Compiles the C core as C (one static library holding every ISA build) while ninja
    compiles the C++ binding, then links the extension."""

    def build_extensions(self):
        from concurrent.futures import ThreadPoolExecutor

        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.sysconfig import customize_compiler

        rules.write_entries()  # the rules' op entries, from MP_RULES's rows (build_tools/rules.py)
        cc = new_compiler(force=self.force)
        customize_compiler(cc)
        # Every unit in parallel, each compiled only if it changed (the source, a header it
        # includes, the command): distutils would compile them all, one after another, on every
        # build. (Not self.force: torch's BuildExtension sets it whenever ninja builds the rest;
        # `make clean` is what rebuilds everything.) It runs beside ninja's C++ compiles, so
        # neither waits for the other's slowest unit with cores idle.
        lib_dir = os.path.join(self.build_temp, "core")
        jobs = core.core_jobs(cc.compiler_so, lib_dir)
        objects = [obj for _, _, obj in jobs]
        self._core_library = cc.library_filename("mpext_core", lib_type="static",
                                                 output_dir=lib_dir)

        def build_core():
            core.compile_all(jobs, log=lambda line: print(line, flush=True))
            cc.create_static_lib(objects, "mpext_core", output_dir=lib_dir)

        with ThreadPoolExecutor(max_workers=1) as pool:
            self._core_built = pool.submit(build_core)
            for ext in self.extensions:
                ext.depends += objects
            super().build_extensions()  # build_extension() below waits for the core

    def build_extension(self, ext):
        from setuptools._distutils.errors import CompileError

        compile_cxx = self.compiler.compile  # torch's ninja compile, set by build_extensions

        def compile_then_wait_for_core(*args, **kwargs):
            objs = compile_cxx(*args, **kwargs)
            try:
                self._core_built.result()
            except core.CompileError as exc:
                raise CompileError("the C core failed to compile:\n%s" % exc) from None
            if self._core_library not in ext.extra_objects:
                # distutils reads extra_objects after compiling, to link them
                ext.extra_objects.append(self._core_library)
            return objs

        self.compiler.compile = compile_then_wait_for_core
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_cxx


def extension():
    sources = sorted(glob.glob("csrc/torch/*.cpp"))
    cuda_sources = [s for s in sources if s.endswith("_cuda.cpp")]
    sources = [s for s in sources if s not in cuda_sources]
    macros = [("MPEXT_TORCH_VERSION", '"%s"' % torch.__version__)] + core.COMMON_MACROS
    # build_tools/core.py says why these flags; the C++ standard is the one cpp_extension picks
    # for this torch.
    flags = EXTENSION_CFLAGS
    # The generated headers first: "rules/rules.h" is the list build_tools/rules.py writes.
    kwargs = dict(include_dirs=[rules.GENERATED_DIR] + core.INCLUDE_DIRS, define_macros=macros,
                  extra_link_args=["-fopenmp"])
    if not WITH_CUDA:
        return cpp_extension.CppExtension("mpext._C", sources,
                                          extra_compile_args={"cxx": flags["cxx"]}, **kwargs)
    macros += [("MPEXT_WITH_CUDA", "1"), ("MPEXT_CUDA_ARCHS", '"%s"' % CUDA_ARCHS)]
    return cpp_extension.CUDAExtension(
        "mpext._C", sources + cuda_sources + sorted(glob.glob("cuda/*.cu")),
        extra_compile_args=flags, **kwargs)


setup(
    install_requires=[requirements.torch_requirement(sys.argv[1:], torch.__version__)],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
)
