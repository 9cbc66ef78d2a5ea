"""The periodic sample log: the learner's recent groups -> samples.jsonl and a compact table."""

import json

import numpy as np

from asyncgrpo.metrics import JsonlSink, SampleLogger, format_samples_table
from asyncgrpo.metrics.samples import sample_records
from asyncgrpo.wire import ScoredGroup


def decode(ids):
    return "".join(chr(i) for i in ids)


def encode(text):
    return [ord(c) for c in text]


def group(prompt: str, completions: list[str], rewards: list[float], version: int, prompt_id: int) -> ScoredGroup:
    tokens = np.asarray([t for c in completions for t in encode(c)], dtype=np.int32)
    return ScoredGroup(
        generator_id=0, seq=prompt_id, prompt_id=prompt_id,
        prompt_tokens=np.asarray(encode(prompt), dtype=np.int32), tokens=tokens,
        logprobs=np.zeros(tokens.size, dtype=np.float32),
        versions=np.full(tokens.size, version, dtype=np.int32),
        lengths=np.asarray([len(c) for c in completions], dtype=np.int32),
        rewards=np.asarray(rewards, dtype=np.float32),
    )


def test_sample_records_are_the_first_groups_as_token_ids():
    groups = [group("37+48=", ["85", "84"], [1.0, 0.0], version=3, prompt_id=7),
              group("1+2=", ["3", "12\n"], [1.0, 0.0], version=4, prompt_id=8),
              group("9+9=", ["18", "18"], [1.0, 1.0], version=5, prompt_id=9)]
    # Staleness counts from the learner's version when it took the groups.
    samples = sample_records(groups, learner_version=5, num_groups=2)
    assert len(samples) == 2
    assert samples[0]["prompt_tokens"] == encode("37+48=")
    assert samples[0]["completions"] == [encode("85"), encode("84")]
    assert samples[0]["rewards"] == [1.0, 0.0]
    assert samples[0]["versions"] == [3, 3] and samples[0]["staleness"] == 2
    assert samples[1]["staleness"] == 1 and samples[1]["prompt_id"] == 8
    json.dumps(samples)  # plain Python values: cheap to ship over Ray, easy to log
    assert sample_records([], learner_version=0, num_groups=4) == []  # before the first step


def test_sample_records_keep_the_oldest_version_of_a_completion_sampled_across_a_push():
    g = group("1+1=", ["22", "2"], [0.0, 1.0], version=4, prompt_id=1)
    g.versions[1] = 5  # a push landed mid-sequence: the first completion's second token came from version 5
    g.versions[2] = 6  # the second completion was sampled at version 6
    assert sample_records([g], learner_version=6, num_groups=1)[0]["versions"] == [4, 6]


def test_sample_records_take_a_completions_oldest_version_from_the_policys_tokens_only():
    g = group("1+1=", ["2=3", "2"], [0.0, 1.0], version=4, prompt_id=1)
    g.policy_mask = np.array([1, 0, 1, 1], dtype=np.uint8)  # "=" came from an environment
    g.versions[1] = 0  # its version entry is ignored
    assert sample_records([g], learner_version=6, num_groups=1)[0]["versions"] == [4, 4]


def test_sample_logger_appends_one_line_per_completion_and_prints_one_row_per_prompt(tmp_path):
    groups = [group("37+48=", ["85", "84"], [1.0, 0.0], version=3, prompt_id=7),
              group("1+2=", ["3", "12\n"], [1.0, 0.0], version=4, prompt_id=8)]
    logger = SampleLogger(tmp_path, decode)
    table = logger.log(100, sample_records(groups, 5, 2), width=100)
    logger.log(200, sample_records(groups[:1], 6, 2), width=100)

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [100] * 4 + [200] * 2
    assert rows[0] == {"step": 100, "prompt": "37+48=", "completion": "85", "reward": 1.0, "version": 3,
                       "staleness": 2, "prompt_id": 7, "generator_id": 0}
    assert rows[3]["completion"] == "12\n"  # the file keeps the text exactly

    lines = table.splitlines()
    assert lines[0] == "samples at step 100: 2 prompts, 4 completions"
    assert len(lines) == 3 + 2  # title, header, rule, one row per prompt
    assert "37+48=" in lines[3] and "85[1]" in lines[3] and "84[0]" in lines[3] and "0.500" in lines[3]
    assert "12\\n[0]" in lines[4]  # the table escapes newlines to stay one row per prompt
    assert all(len(line) <= 100 for line in lines)


def test_table_clips_long_completions_to_the_width():
    rows = [{"step": 1, "prompt": "p" * 80, "prompt_id": 0, "completion": "x" * 500, "reward": 0.5, "version": 0,
             "staleness": 0}]
    lines = format_samples_table(1, rows, width=60).splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert lines[-1].endswith("…")


class FakeLearner:
    """The loop's view of the learner ranks, in process: train_steps(k) returns k step records."""

    def __init__(self):
        self.version = 0

    def train_steps(self, k):
        records = []
        for _ in range(k):
            self.version += 1
            records.append({"step": self.version, "samples": 16 * self.version, "reward/mean": 0.5,
                            "staleness/max": 1, "queue/dropped_stale": 0})
        return records

    def recent_samples(self, k):
        groups = [group("1+1=", ["2", "3"], [1.0, 0.0], version=self.version - 1, prompt_id=i) for i in range(5)]
        return sample_records(groups, self.version, k)


def test_loop_logs_samples_at_the_first_chunk_boundary_past_each_multiple(tmp_path):
    from asyncgrpo.config import load
    from asyncgrpo.driver.loop import run_loop

    cfg = load([f"run_dir={tmp_path}", "progress=false", "train.max_steps=23", "train.steps_per_call=4",
                "log.samples_every_steps=5", "log.samples_per_log=3"])
    summary = {}
    metrics = JsonlSink(tmp_path)
    run_loop(cfg, FakeLearner(), metrics, SampleLogger(tmp_path, decode), summary)
    metrics.close()

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # Chunks end at 4, 8, 12, 16, 20, 23; multiples of 5 are first reached at 8, 12, 16, 20.
    assert sorted({r["step"] for r in rows}) == [8, 12, 16, 20]
    assert len(rows) == 4 * 3 * 2  # 3 prompts x 2 completions per log
    assert rows[0]["prompt"] == "1+1=" and rows[0]["staleness"] == 1
    assert summary["steps"] == 23
