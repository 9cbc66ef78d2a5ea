"""A look at what the policy actually writes: a few prompts, their completions and rewards.

The learner hands over token ids (`sample_records` of the groups of its last step); the driver
decodes them, prints a compact table and appends one JSON line per completion to run_dir/samples.jsonl.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from asyncgrpo.contract import staleness

if TYPE_CHECKING:
    from asyncgrpo.wire.messages import ScoredGroup

Decode = Callable[[list[int]], str]


def sample_records(groups: list[ScoredGroup], learner_version: int, num_groups: int) -> list[dict[str, Any]]:
    """The first `num_groups` of `groups`, as plain token ids (cheap to ship over Ray, easy to log).

    `learner_version` is the learner's version when it took the groups: staleness counts from it."""
    records = []
    for group in groups[:num_groups]:
        completions = [group.completion(i) for i in range(group.num_samples)]
        records.append({
            "prompt_id": int(group.prompt_id),
            "generator_id": int(group.generator_id),
            "prompt_tokens": group.prompt_tokens.tolist(),
            "completions": [tokens.tolist() for tokens, _, _ in completions],
            "rewards": group.rewards.astype(float).tolist(),
            # The oldest weights that sampled each completion (all of it, unless a push landed mid-sequence);
            # an environment's tokens (policy mask 0) were sampled by none.
            "versions": [int(sampled.min()) if sampled.size else group.version_min
                         for sampled in (versions[group.completion_mask(i) == 1]
                                         for i, (_, _, versions) in enumerate(completions))],
            "staleness": staleness(group.version_min, learner_version),
        })
    return records


def _one_line(text: str) -> str:
    """Completions may hold newlines or tabs; the table must stay one row per prompt."""
    return text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def decode_samples(step: int, groups: list[dict[str, Any]], decode: Decode) -> list[dict[str, Any]]:
    """One record per completion: step, prompt, completion, reward, version, staleness, ids."""
    rows = []
    for group in groups:
        prompt = decode(list(group["prompt_tokens"]))
        for i, tokens in enumerate(group["completions"]):
            rows.append({
                "step": step,
                "prompt": prompt,
                "completion": decode(list(tokens)),
                "reward": float(group["rewards"][i]),
                "version": int(group["versions"][i]),
                "staleness": int(group["staleness"]),
                "prompt_id": int(group.get("prompt_id", -1)),
                "generator_id": int(group.get("generator_id", -1)),
            })
    return rows


def format_samples_table(step: int, rows: list[dict[str, Any]], width: int | None = None) -> str:
    """One line per prompt: prompt | mean reward | staleness | completions with their rewards."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    by_prompt: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        by_prompt.setdefault((row["prompt"], row["prompt_id"]), []).append(row)
    prompt_width = min(32, width // 3, max([len("prompt")] + [len(_one_line(p)) for p, _ in by_prompt]))
    header = f"{'prompt':<{prompt_width}} | reward | stale | completions [reward]"
    lines = [f"samples at step {step}: {len(by_prompt)} prompts, {len(rows)} completions", header,
             "-" * min(width, max(len(header), 40))]
    for (prompt, _), completions in by_prompt.items():
        mean_reward = sum(r["reward"] for r in completions) / len(completions)
        shown = "  ".join(f"{_one_line(r['completion'])!s}[{r['reward']:g}]" for r in completions)
        prefix = f"{_clip(_one_line(prompt), prompt_width):<{prompt_width}} | {mean_reward:6.3f} | {completions[0]['staleness']:5d} | "
        lines.append(prefix + shown)
    return "\n".join(_clip(line, width) for line in lines)


class SampleLogger:
    """Decodes `sample_records` output, appends it to samples.jsonl, returns the table."""

    def __init__(self, run_dir: str | Path, decode: Decode) -> None:
        self.path = Path(run_dir) / "samples.jsonl"
        self.decode = decode

    @classmethod
    def from_tokenizer_dir(cls, run_dir: str | Path, tokenizer_dir: str) -> SampleLogger:
        """Decoding with the model's tokenizer, loaded at the first decode: a run that logs no
        samples never loads it."""
        tokenizer = None

        def decode(ids: list[int]) -> str:
            nonlocal tokenizer
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            return tokenizer.decode(ids, skip_special_tokens=True)

        return cls(run_dir, decode)

    def log(self, step: int, groups: list[dict[str, Any]], width: int | None = None) -> str:
        rows = decode_samples(step, groups, self.decode)
        with self.path.open("a") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
        return format_samples_table(step, rows, width)
