"""Request checks that run before anything reaches the scheduler (no engine needed)."""

from types import SimpleNamespace

import pytest

from rhyme_sglang.sglang_ext.validation import check_generate_body, check_rhyme_params


@pytest.mark.parametrize("custom", [{"rhyme_prompt_id": 3}, {"rhyme_prompt_id": ""},
                                    {"rhyme_prompt_id": ["p"]}, {"rhyme_sample": -1},
                                    {"rhyme_sample": True}, {"rhyme_sample": 1.5}, "p"])
def test_bad_rhyme_params_are_named(custom):
    with pytest.raises(ValueError, match="custom_params"):
        check_rhyme_params({"custom_params": custom})
    problem = check_generate_body({"input_ids": [1], "sampling_params": {"custom_params": custom}})
    assert problem is not None and "custom_params" in problem


@pytest.mark.parametrize("params", [None, {}, {"custom_params": None}, {"custom_params": {}},
                                    {"custom_params": {"rhyme_prompt_id": "p", "rhyme_sample": 0}},
                                    {"custom_params": {"other_key": [1]}}])
def test_good_rhyme_params_pass(params):
    check_rhyme_params(params)
    assert check_generate_body({"input_ids": [1], "sampling_params": params}) is None


def test_worker_ignores_malformed_values_it_reads():
    """The scheduler-side reader never hands a malformed value to the store (defence in depth)."""
    from rhyme_sglang.sglang_ext.worker import _custom

    def req(custom):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))

    assert _custom(req({"rhyme_prompt_id": "p", "rhyme_sample": 2}), "rhyme_prompt_id") == "p"
    assert _custom(req({"rhyme_prompt_id": "p", "rhyme_sample": 2}), "rhyme_sample") == 2
    assert _custom(req({"rhyme_prompt_id": 5}), "rhyme_prompt_id") is None
    assert _custom(req({"rhyme_sample": -1}), "rhyme_sample") is None
    assert _custom(req(None), "rhyme_sample") is None
