"""The driver forwards exactly the full responses a prompt's home engine lacks (no engine:
the histories it builds are imported into a real DraftStore)."""

from rhyme_sglang.core import DraftStore
from rl_driver.dispatch import Job
from rl_driver.pool import responses_to_forward


def _job(sample, engines, generation, response):
    job = Job(prompt_id="p", sample=sample, prompt_ids=[7, 8], predicted=4.0, max_new_tokens=16)
    job.engines, job.engine, job.final_generation = engines, engines[-1], generation
    job.response_ids = response
    return job


def test_migrated_reissued_and_restarted_responses_go_home_in_full():
    jobs = [_job(0, [0], 0, [1, 2]),            # one segment on a live engine: stays
            _job(1, [0, 1], 0, [3, 4, 5]),      # migrated 0 -> 1
            _job(2, [1, -1, 1], 1, [6, 7]),     # re-issued on engine 1 after its restart
            _job(3, [1], 0, [8])]               # finished by engine 1, restarted since
    rewards = {"p/1": 1.0, "p/2": 0.0, "p/3": 0.5}
    out = responses_to_forward(jobs, rewards, generation=[0, 1])
    assert set(out) == {(0, "p"), (1, "p")}
    assert [r["sample"] for r in out[(0, "p")]["records"]] == [1]
    assert [(r["sample"], r["response"], r["reward"]) for r in out[(1, "p")]["records"]] == \
        [(2, [6, 7], 0.0), (3, [8], 0.5)]
    home = DraftStore()
    home.add_response("p", [7, 8], [7], 0, sample=2)  # the partial record of sample 2
    assert home.import_prompt(out[(1, "p")], replace=True) == 2
    assert sorted((r.sample, list(r.seq)[-2:]) for r in home.records()) == [(2, [6, 7]), (3, [8, 8])]
    assert home.check_integrity()
