"""benchmarks.trace_stats: the reuse statistic of benchmarks/data/README.md, per epoch."""

import pytest

from benchmarks.trace_stats import epoch_stats, format_table
from rhyme_sglang.core import TraceRecord


def _rec(pid, epoch, sample, resp, reward=0.0, reason="stop"):
    return TraceRecord(prompt_id=pid, epoch=epoch, sample=sample, prompt_token_ids=[1, 2],
                       response_token_ids=resp, reward=reward, finish_reason=reason)


def test_reuse_counts_tokens_whose_context_appeared_in_the_previous_epoch_of_the_prompt():
    records = [
        _rec("a", 0, 0, [1, 2, 3, 4, 5, 6, 7]),
        _rec("b", 0, 0, [9, 9, 9, 9, 9, 9]),
        # a's tokens 5 and 6 have their 4-token context + token in epoch 0 of "a", 8 does not;
        # "b"'s epoch-0 text does not count for prompt "a"
        _rec("a", 1, 0, [1, 2, 3, 4, 5, 6, 8], reward=1.0, reason="length"),
        _rec("a", 1, 1, [9, 9, 9, 9, 9], reward=0.0),
    ]
    rows = epoch_stats(records, context=4)
    assert rows[0]["reuse"] is None and rows[0]["responses"] == 2
    one = rows[1]
    assert one["reuse"] == pytest.approx(2 / 4)  # hits 5, 6 of tokens 5, 6, 8 and the last 9
    assert one["mean_reward"] == 0.5 and one["capped"] == 1
    assert one["max_length"] == 7 and one["median_length"] == 6
    assert "| 1 | 2 | 0.500 |" in format_table(rows)


def test_context_must_be_positive():
    with pytest.raises(ValueError, match="context"):
        epoch_stats([_rec("a", 0, 0, [1, 2])], context=0)
