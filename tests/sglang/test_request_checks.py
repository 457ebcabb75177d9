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
    from rhyme_sglang.sglang_ext.validation import custom_param as _custom

    def req(custom):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))

    assert _custom(req({"rhyme_prompt_id": "p", "rhyme_sample": 2}), "rhyme_prompt_id") == "p"
    assert _custom(req({"rhyme_prompt_id": "p", "rhyme_sample": 2}), "rhyme_sample") == 2
    assert _custom(req({"rhyme_prompt_id": 5}), "rhyme_prompt_id") is None
    assert _custom(req({"rhyme_sample": -1}), "rhyme_sample") is None
    assert _custom(req(None), "rhyme_sample") is None


@pytest.mark.parametrize("body", [
    {"text": "hi", "model": "tiny"},  # sglang-router adds `model`
    {"input_ids": [1, 2], "bogus_field": 1, "another": {"x": 1}},
    {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
])
def test_fields_sglang_accepts_are_accepted(body):
    assert check_generate_body(body) is None


def test_unknown_top_level_fields_are_logged_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="rhyme_sglang.sglang_ext.validation"):
        for _ in range(3):
            assert check_generate_body({"text": "x", "zz_once_field": 1}) is None
    assert sum("zz_once_field" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("body, needle", [
    ([1, 2], "JSON object"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),  # sglang's own gate
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "invalid /generate"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": -1}]},
     "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "invalid /generate"),
    ({"input_ids": "abc"}, "invalid /generate"),
    ({"input_ids": [[1], [2, "a"]]}, "invalid /generate"),
    ({"text": "x", "stream": "yes"}, "invalid /generate"),
    ({"input_ids": [1], "sampling_params": {"custom_params": "p"}}, "custom_params"),
])
def test_values_that_would_crash_or_corrupt_get_a_message(body, needle):
    problem = check_generate_body(body)
    assert problem is not None and needle in problem
