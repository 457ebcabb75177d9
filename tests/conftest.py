"""Shared fixtures. Engines are expensive (~20 s to start): one per session and config."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

from rhyme_sglang import settings
from tests.markers import derived_markers

settings.prepare_cpu_env()
# RHYME engines keep measured step costs between starts; each test process gets its own file,
# so no test starts from another run's (or the user's) cost table
os.environ.setdefault("RHYME_STEP_COSTS", os.path.join(
    tempfile.mkdtemp(prefix="rhyme-step-costs-"), "step_costs.json"))
settings.reload()


class _SettingsMonkeyPatch(pytest.MonkeyPatch):
    """pytest's ``monkeypatch`` whose environment changes reach :mod:`rhyme_sglang.settings`
    (the library reads its ``RHYME_*`` switches once per process)."""

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        settings.reload()

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        settings.reload()


@pytest.fixture
def monkeypatch():
    patch = _SettingsMonkeyPatch()
    yield patch
    patch.undo()
    settings.reload()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    missing = {
        "sglang": None if _has("sglang") else "sglang is not installed (run `make setup`)",
        "ray": None if _has("ray") else "ray is not installed (run `make setup`)",
        "torch": None if _has("torch") else "torch is not installed (run `make setup`)",
        "gpu": "needs a CUDA GPU",
    }
    try:
        import torch

        if torch.cuda.is_available():
            missing["gpu"] = None
    except ImportError:
        pass
    for item in items:
        for marker in derived_markers(item) - set(item.keywords):
            item.add_marker(marker)
        for marker, reason in missing.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rhyme_sglang.models import prepare_tiny

    return str(prepare_tiny())


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from rhyme_sglang.models import prepare_smollm2

    return str(prepare_smollm2())


class EnginePool:
    """Starts engines lazily, one per configuration, and shuts them all down at the end.

    sglang keeps server arguments in process-global state, so two live engines with
    different configurations in one process interfere: only one engine is alive at a time
    (getting another shuts the current one down). Tests that compare configurations
    compute the baseline first, then switch.
    """

    def __init__(self):
        self._engines = {}

    def get(self, name: str, **kwargs):
        if name not in self._engines:
            from rhyme_sglang import Engine

            self.close_all()

            kwargs.setdefault("log_level", "warning")
            self._engines[name] = Engine(**kwargs)
        return self._engines[name]

    def close(self, name: str) -> None:
        engine = self._engines.pop(name, None)
        if engine is not None:
            engine.shutdown()

    def close_all(self) -> None:
        for name in list(self._engines):
            self.close(name)


@pytest.fixture(scope="session")
def engines():
    pool = EnginePool()
    yield pool
    pool.close_all()


# RHYME engines run up to 512 requests at once, as the vanilla one does by default: at RHYME's
# default of 48 the lossless suite's 3-token samples went through in waves of 48, 4.0 ms a
# sample against 2.5 at 512 (vanilla: 1.5; stop 27, 4096 samples, 2-core AMX Xeon). Same
# samples, same counts: only how many share a step. NGRAM keeps SGLang's default: its corpus
# learns from earlier waves, and at 512 at once it accepted too few drafts (3991 of the 4000
# the sampling test asks for, to show speculation ran).
_SPEC_BATCH = {"max_running_requests": 512}
TINY_CONFIGS = {
    "tiny": {},
    "tiny-ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    # lossless tests force verify steps on every decode step (the cost model may otherwise
    # replace them by plain decode steps); "tiny-rhyme-adaptive" keeps the cost model on
    "tiny-rhyme": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 8,
                   "rhyme_adaptive": False, **_SPEC_BATCH},
    "tiny-rhyme-adaptive": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 8},
    # every verify width (1, 2, 4, 8, 16) and plain decode in turn, with every switch
    "tiny-rhyme-cycle": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 17,
                         "rhyme_cycle_widths": True, **_SPEC_BATCH},
    # the same walk with one width per step for the whole batch, each request padded to it
    # (per-request widths off: how RHYME runs on a GPU)
    "tiny-rhyme-cycle-batch-width": {"speculative_algorithm": "RHYME",
                                     "speculative_num_draft_tokens": 17, "rhyme_cycle_widths": True,
                                     "rhyme_ragged": False, **_SPEC_BATCH},
}


@pytest.fixture(scope="session")
def tiny(engines, tiny_model_path):
    """``tiny(name, **extra)`` -> the live engine for that configuration (see ``TINY_CONFIGS``),
    in fp32 unless ``extra`` gives a ``dtype``."""

    def get(name: str = "tiny", **extra):
        config = {"dtype": "float32", **TINY_CONFIGS[name], **extra}
        key = name + "".join(f"|{k}={v}" for k, v in sorted(extra.items()))
        return engines.get(key, model_path=tiny_model_path, **config)

    return get


@pytest.fixture()
def tiny_engine(tiny):
    return tiny("tiny")
