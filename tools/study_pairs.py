"""Paired comparisons between any two cells of finished studies, within one study or across two.

    .venv/bin/python -m tools.study_pairs --pair docs/studies/longtail_divergence:divergence_0.01 \\
        docs/studies/longtail_divergence:versions_2
    .venv/bin/python -m tools.study_pairs \\
        --pair docs/studies/longtail_divergence_naive:versions_8 docs/studies/longtail_divergence:versions_8

A study's report pairs every cell with its one baseline (docs/STUDIES.md, "The statistics"); this
pairs the cells you name, by seed, with the same statistics: samples/s and the training loop's
seconds as the geometric mean of the per-seed ratios (`paired_ratio`), accuracy as the mean
per-seed difference (`paired_difference`), each with its 95% t-interval over the seeds both cells
finished. Across two studies the pairing means what it means inside one only when the two ran the
same task, steps and seeds and differ in the cells' settings alone (a study that adds one factor to
another's base, e.g. longtail_divergence_naive beside longtail_divergence).

A side is `STUDY:CELL`: STUDY a study directory (its results.csv) or a results.csv itself; CELL the
value of the grid's one factor (`versions_2`), or `key=value` joined by `,` for a grid of several
(`train.fixed_staleness=4,mode=bypass`). Prints a table, then a JSON line with every row.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from asyncgrpo.study.pairing import markdown_table
from asyncgrpo.study.report import DIFFERENCE_METRICS, RATIO_METRICS, ROUNDING
from asyncgrpo.study.stats import Estimate, paired_difference, paired_ratio


class PairError(ValueError):
    """A side that names no readable study or no cell of it: one line for the user."""


def results_path(study: str) -> Path:
    path = Path(study)
    path = path / "results.csv" if path.is_dir() else path
    if not path.is_file():
        raise PairError(f"{study}: no results.csv there (a study directory or its results.csv)")
    return path


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The grid's factor columns (results.csv puts them before `seed`) and the finished runs' rows."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        rows = list(reader)
    if "seed" not in columns or "status" not in columns:
        raise PairError(f"{path}: not a study's results.csv (no `seed` or `status` column)")
    return columns[:columns.index("seed")], [row for row in rows if row["status"] == "finished"]


def parse_cell(text: str, factors: list[str], where: str) -> dict[str, str]:
    """`value` for a one-factor grid, else `key=value,key=value` naming every factor."""
    if "=" not in text:
        if len(factors) != 1:
            raise PairError(f"{where}: cell {text!r} needs key=value for each of the grid's factors {factors}")
        return {factors[0]: text}
    cell = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in factors:
            raise PairError(f"{where}: {part!r} is not key=value with a key among the grid's factors {factors}")
        cell[key.strip()] = value.strip()
    missing = [f for f in factors if f not in cell]
    if missing:
        raise PairError(f"{where}: cell {text!r} leaves out the factors {missing}")
    return cell


def cell_runs(side: str) -> dict[int, dict[str, str]]:
    """The finished runs of one `STUDY:CELL`, by seed."""
    study, sep, cell_text = side.rpartition(":")
    if not sep or not study or not cell_text:
        raise PairError(f"{side!r}: expected STUDY:CELL (a study directory or results.csv, then the cell)")
    path = results_path(study)
    factors, rows = read_rows(path)
    cell = parse_cell(cell_text, factors, str(path))
    matching = [row for row in rows if all(row[k] == v for k, v in cell.items())]
    runs = {int(row["seed"]): row for row in matching}
    if len(runs) < len(matching):
        seeds = sorted(int(row["seed"]) for row in matching)
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        raise PairError(f"{path}: cell {cell_text!r} has more than one finished run of seed(s) {twice}; "
                        "which one to pair is not clear")
    if not runs:
        values = sorted({",".join(f"{k}={row[k]}" for k in factors) for row in rows})
        raise PairError(f"{path}: no finished run of cell {cell_text!r}; its cells: {values}")
    return runs


def _values(runs: dict[int, dict[str, str]], column: str) -> dict[int, float | None]:
    return {seed: _number(row.get(column)) for seed, row in runs.items()}


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def compare(a: dict[int, dict[str, str]], b: dict[int, dict[str, str]]) -> dict[str, Any]:
    """A against B over the seeds both finished: ratios for throughput, differences for accuracy."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise PairError(f"the two cells share no finished seed (seeds {sorted(a)} against {sorted(b)})")
    row: dict[str, Any] = {"seeds": seeds}
    for column, _ in RATIO_METRICS:
        row[column] = _as_dict(paired_ratio(_values(a, column), _values(b, column)))
    for column, _ in DIFFERENCE_METRICS:
        row[column] = _as_dict(paired_difference(_values(a, column), _values(b, column)))
    return row


def _as_dict(estimate: Estimate) -> dict[str, Any]:
    return {"n": estimate.n, "mean": estimate.mean, "low": estimate.low, "high": estimate.high}


def _fmt(estimate: dict[str, Any], ratio: bool) -> str:
    if estimate["mean"] is None:
        return "-"
    form = "{:.2f}x" if ratio else "{:+.3f}"
    text = form.format(estimate["mean"])
    if estimate["low"] is None:
        return text
    text += " [" + ", ".join((("{:.2f}" if ratio else "{:+.3f}").format(v)) for v in (estimate["low"], estimate["high"])) + "]"
    # The report's margin for float rounding: equal values paired are not exactly 0 apart (or 1x).
    null = 1.0 if ratio else 0.0
    separated = estimate["low"] > null + ROUNDING or estimate["high"] < null - ROUNDING
    return f"**{text}**" if separated else text


def table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["A", "B", "pairs"] + [f"{name} A/B" for _, name in RATIO_METRICS] + [f"{name} A-B" for _, name in DIFFERENCE_METRICS]
    return markdown_table(header, [
        [row["a"], row["b"], str(len(row["seeds"]))] + [_fmt(row[c], True) for c, _ in RATIO_METRICS]
        + [_fmt(row[c], False) for c, _ in DIFFERENCE_METRICS] for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", nargs=2, action="append", required=True, metavar=("A", "B"),
                        help="STUDY:CELL STUDY:CELL, A compared with B; repeat for more pairs")
    args = parser.parse_args(argv)
    rows = []
    try:
        for a, b in args.pair:
            rows.append({"a": a, "b": b, **compare(cell_runs(a), cell_runs(b))})
    except PairError as error:
        print(f"study_pairs: {error}", file=sys.stderr)
        return 2
    print("\n".join(table(rows)))
    print("Ratios: geometric mean of per-seed A/B; differences: mean of per-seed A-B; 95% t-intervals, "
          "bold where the interval excludes 1x (a ratio) or 0 (a difference): a difference the seeds support.")
    print(json.dumps({"pairs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
