"""Interpreter-start hook that makes the CPU backend reach every sglang process.

Installed as a ``.pth`` line (``import rhyme_sglang.cpu_backend.bootstrap``) by
``python -m rhyme_sglang.cpu_backend install``. It must stay cheap: it imports only the
standard library and does nothing until one of the watched modules is imported.

It adds two meta-path finders: one *appended last*, so that

* ``sgl_kernel`` (and its submodules) resolve to our pure-PyTorch stand-in only when no
  other finder knows ``sgl_kernel`` - on a GPU machine with the real CUDA package the
  stand-in is never seen;

and one *inserted first* that only wraps the loaders of a few named modules, so that
* ``torchvision`` gets its missing ``torchvision::nms``/``qnms`` schemas declared first
  when a CPU torch sits next to PyPI's CUDA torchvision build;
* selected sglang modules get the CPU patches of :mod:`.patches` applied right after
  they execute, but only while the stand-in is the active ``sgl_kernel``.

Set ``RHYME_CPU_BACKEND=0`` to disable everything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

STANDIN_PACKAGE = "rhyme_sglang.cpu_backend.standin"
_PATCHED_MODULES = (
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.layers.sampler",
    "sglang.srt.sampling.sampling_batch_info",
    "sglang.srt.layers.quantization.unquant",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.model_executor.model_runner_components.weight_updater",
    "sglang.srt.layers.attention.intel_amx_backend",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.rotary_embedding.base",
    "sglang.srt.layers.activation",
    "sglang.srt.models.llama",
    "sglang.srt.models.qwen2",
)  # the keys of ``patches._BY_MODULE`` (kept apart so start-up imports nothing more)


class _HookedLoader(importlib.abc.Loader):
    """Wraps a real loader: runs ``before`` ahead of the module body, ``after`` behind it."""

    def __init__(self, inner, before=None, after=None):
        self._inner = inner
        self._before = before
        self._after = after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        if self._before is not None:
            self._before()
        self._inner.exec_module(module)
        if self._after is not None:
            self._after(module)


class StandinFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: answers ``sgl_kernel`` only when nothing else does."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return _standin_spec(fullname)
        return None


class HookFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: wraps the loaders of the few modules we patch."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            return _hooked_spec(self, fullname, path, target, before=_declare_torchvision_ops)
        if fullname in _PATCHED_MODULES:
            return _hooked_spec(self, fullname, path, target, after=_apply_patch)
        return None


def _standin_spec(fullname: str):
    real = STANDIN_PACKAGE + fullname[len("sgl_kernel") :]
    real_spec = importlib.util.find_spec(real)
    if real_spec is None or real_spec.origin is None:
        return None  # unknown submodule: a plain ModuleNotFoundError for the caller
    is_pkg = real_spec.submodule_search_locations is not None
    return importlib.util.spec_from_file_location(
        fullname,
        real_spec.origin,
        submodule_search_locations=list(real_spec.submodule_search_locations) if is_pkg else None,
    )


def _hooked_spec(finder, fullname, path, target, before=None, after=None):
    for other in sys.meta_path:
        if isinstance(other, (HookFinder, StandinFinder)) or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, before, after)
            return spec
    return None


def _apply_patch(module) -> None:
    if not standin_active():
        return
    from rhyme_sglang.cpu_backend import patches

    patches.apply_to_module(module)


def standin_active() -> bool:
    """True when ``sgl_kernel`` is (or will be) our stand-in rather than a real build."""
    mod = sys.modules.get("sgl_kernel")
    if mod is not None:
        return bool(getattr(mod, "__rhyme_cpu_standin__", False))
    for other in sys.meta_path:
        if isinstance(other, (HookFinder, StandinFinder)) or not hasattr(other, "find_spec"):
            continue
        try:
            if other.find_spec("sgl_kernel", None) is not None:
                return False
        except Exception:  # a broken finder must not break start-up
            continue
    return True


def _declare_torchvision_ops() -> None:
    import torch  # torchvision imports it first anyway

    if getattr(torch.version, "cuda", None) is not None:
        return
    from rhyme_sglang.cpu_backend import patches

    patches.declare_torchvision_ops()


def install() -> None:
    """Append the finder once (idempotent)."""
    from rhyme_sglang.settings import backend_enabled

    if not backend_enabled():
        return
    if not any(isinstance(f, StandinFinder) for f in sys.meta_path):
        sys.meta_path.append(StandinFinder())
    if not any(isinstance(f, HookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, HookFinder())


install()
