"""Few-shot prompt styles of rl_driver.tasks: the worked examples are correct procedures."""

import re

import pytest

from rl_driver.tasks import (PROMPT_STYLES, chat_messages, letter_count_solution,
                             long_addition_solution, running_sum_solution)


def test_running_sum_example_lines_are_correct_sums():
    text = running_sum_solution([4, 7, 2, 9])
    assert text.splitlines() == ["Start with 4.", "4 + 7 = 11", "11 + 2 = 13", "13 + 9 = 22",
                                 "<answer>22</answer>"]


@pytest.mark.parametrize("a,b", [(4805, 739), (999, 1), (12, 345678)])
def test_long_addition_example_reads_back_the_sum(a, b):
    text = long_addition_solution(a, b)
    assert f"<answer>{a + b}</answer>" in text
    assert re.search(r"from last to first: (\d+)\.", text).group(1) == str(a + b)


def test_styles_build_chat_turns_and_reject_unknown_names():
    for style, (instruction, shots) in PROMPT_STYLES.items():
        msgs = chat_messages("Calculate 1 + 2.", len(shots), style)
        assert len(msgs) == 2 + 2 * len(shots) and msgs[-1]["content"].endswith(instruction)
    with pytest.raises(ValueError, match="prompt_style"):
        chat_messages("Calculate 1 + 2.", 1, "poetry")


def test_letter_count_example_counts_each_word_and_keeps_the_total():
    text = letter_count_solution(["Green", "cat", "trees"], "e")
    assert text.splitlines() == ["Green -> 2 (total 2)", "cat -> 0 (total 2)",
                                 "trees -> 2 (total 4)", "<answer>4</answer>"]
