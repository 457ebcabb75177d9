"""The scheduler breakdown's hooks record a decode step before its outputs are streamed."""

from types import SimpleNamespace


def _decode_mode():
    """A decode batch's ``forward_mode``, as the hooks ask it."""
    return SimpleNamespace(is_extend=lambda: False, is_mixed=lambda: False, is_decode=lambda: True)


def test_a_decode_step_is_in_the_breakdown_before_its_outputs_stream_and_only_once():
    """A client that has its output may reset the breakdown at once (stop 46: a test's reset
    raced the previous generate's last step, recorded after streaming); the step is now
    recorded from the stream hook, and the result hook does not record it again."""
    from rhyme_sglang.sglang_ext import plugin, timeline

    timeline.breakdown(reset=True)
    req = SimpleNamespace(output_ids=[1, 2], finished=lambda: False)
    batch = SimpleNamespace(forward_mode=_decode_mode(), reqs=[req], extend_num_tokens=0)
    scheduler = SimpleNamespace(spec_algorithm=None, server_args=None, waiting_queue=[])
    timeline.run_batch_hook(lambda *a, **k: "ran", scheduler, batch)
    seen = {}

    def process_result(scheduler, batch):
        req.output_ids.append(3)
        plugin.stream_hook(None, batch.reqs)  # sglang streams inside process_batch_result
        seen["at_stream"] = timeline.breakdown(reset=True)["decode"]

    timeline.result_hook(process_result, scheduler, batch)
    assert seen["at_stream"]["plain"]["steps"] == 1 and seen["at_stream"]["plain"]["tokens"] == 1
    assert timeline.breakdown()["decode"] == {}  # not recorded a second time after the reset


def test_a_stream_outside_result_processing_leaves_the_pending_step():
    """An abort streams a request between a step's forward and its result: the step is still
    recorded, by its result."""
    from rhyme_sglang.sglang_ext import plugin, timeline

    timeline.breakdown(reset=True)
    req = SimpleNamespace(output_ids=[1], finished=lambda: True)
    batch = SimpleNamespace(forward_mode=_decode_mode(), reqs=[req], extend_num_tokens=0)
    scheduler = SimpleNamespace(spec_algorithm=None, server_args=None, waiting_queue=[])
    timeline.run_batch_hook(lambda *a, **k: None, scheduler, batch)
    plugin.stream_hook(None, [])
    timeline.result_hook(lambda *a, **k: req.output_ids.append(9), scheduler, batch)
    assert timeline.breakdown()["decode"]["plain"]["steps"] == 1
