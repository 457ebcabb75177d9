"""Imported once by the fork server (:mod:`rhyme_sglang.sglang_ext.forkserver`): the CPU backend
is activated first (it patches sglang modules as they are imported), then what an engine's
scheduler and detokenizer import, so the children forked from here start with it loaded."""

from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults

apply_cpu_defaults({})

import sglang.srt.managers.detokenizer_manager  # noqa: E402,F401
import sglang.srt.managers.scheduler  # noqa: E402,F401
import sglang.srt.model_executor.model_runner  # noqa: E402,F401

import rhyme_sglang.sglang_ext.plugin  # noqa: E402,F401
import rhyme_sglang.sglang_ext.process  # noqa: E402,F401
import rhyme_sglang.sglang_ext.worker  # noqa: E402,F401
