"""Benchmarks, studies and fault drills around asyncgrpo, run from the repository root as modules,
`python -m tools.NAME` (tools that use another import it as `from tools import NAME`):

    bench_async         async vs sync throughput, interleaved repeats
    bench_dispatch      uneven generators under tickets against each alone, measured
    bench_learner       learner step time and memory at world size 1 and 2
    bench_peer          asyncgrpo against TRL's GRPOTrainer, side by side
    bench_push          weight-push latency, zmq and shm
    bench_lora          a LoRA run's generators: adapters merged vs vLLM's LoRA path, beside full FT
    bench_real          a step's anatomy at real model shapes
    bench_tail          the continuous generator against the call-batched one and sync, long completions
    bench_env           environment latency hidden: the calculator tool with 0-200 ms per call, sync vs async
    bench_wire          the group stream against a Ray queue and memcpy
    chaos               each fault injected into a real run, checked (docs/RELIABILITY.md)
    soak                a long run with a generator killed every few minutes
    validate_simulator  simulator predictions against real runs
    predict_cluster     the simulator on GPU clusters no one here can run
    dispatch_study      uneven generators under tickets against each alone, simulated
    probe_vllm_lora     vLLM's LoRA path vs merging adapters in place, measured (docs/LORA.md)
    study_pairs         any two cells of finished studies paired by seed, within one study or across two

gpu_check.sh, beside them, is the checks that need an NVIDIA GPU as one shell script.

Below, what the tools check on their command lines, shared: bad input is refused in one line
(argparse's `parser.error`: exit status 2) before anything expensive starts (a run, an engine, an
output folder).

- argparse types: `positive_int`, `nonnegative_int`, `finite_float`, `positive_float` (0 < x < inf),
  `nonnegative_float` (0 <= x < inf);
- `comma_list` (`list_type` as an argparse type): 'a,b' -> items, converted, none empty, none
  repeated (two modes would share a run folder);
- `check_overrides`: every override key=value, none of the keys the tool sets itself;
- `load_config`: the overrides composed as a run will compose them (asyncgrpo.config.load), a
  ConfigError turned into `parser.error` naming what was being composed;
- `fresh_dir`: a new time-stamped folder under a root, so that a rerun never meets the last one's runs.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _number(text: str, kind: type, what: str) -> Any:
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"wants an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"wants an integer >= 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    value = _number(text, float, "a finite number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"wants a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a finite number > 0")
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"wants a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(text, float, "a finite number >= 0")
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"wants a finite number >= 0, got {text!r}")
    return value


def comma_list(text: str, convert: Callable[[str], T] = str, *, choices: Iterable[str] | None = None,  # type: ignore[assignment]
               allow_empty: bool = False, unique: bool = True, what: str = "") -> list[T]:
    """'a, b' -> [convert('a'), convert('b')]: no empty item (unless the whole list is empty and
    `allow_empty`), each of `choices` when given, and no value twice unless not `unique` (after
    conversion: '50,050' repeats 50). argparse.ArgumentTypeError, in one line (after `what`, e.g.
    the option), otherwise."""
    def refuse(message: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"{what}: {message}" if what else message)

    items = [item.strip() for item in text.split(",")]
    if allow_empty and not any(items):
        return []
    if not text.strip() or not all(items):
        raise refuse(f"wants a comma-separated list without empty items, got {text!r}")
    if choices is not None:
        known = list(choices)
        unknown = [item for item in items if item not in known]
        if unknown:
            raise refuse(f"unknown {', '.join(unknown)} (choose from {', '.join(known)})")
    values = []
    for item in items:
        try:
            values.append(convert(item))
        except argparse.ArgumentTypeError as err:  # names the item already
            raise refuse(str(err)) from None
        except (TypeError, ValueError) as err:
            raise refuse(f"{item!r}: {err}") from None
    twice = repeated(values) if unique else []
    if twice:
        raise refuse(f"{', '.join(twice)} given twice in {text!r}")
    return values


def repeated(values: Sequence[Any]) -> list[str]:
    """The values that come more than once, in order, as texts (two modes of one value would share
    a run folder)."""
    return [str(v) for v in sorted({v for i, v in enumerate(values) if v in values[:i]})]


def list_type(convert: Callable[[str], T] = str, **options: Any) -> Callable[[str], list[T]]:
    """`comma_list` as an argparse type."""
    def parse(text: str) -> list[T]:
        return comma_list(text, convert, **options)
    return parse


def check_overrides(parser: argparse.ArgumentParser, overrides: Sequence[str], reserved: Sequence[str] = (),
                    who: str = "the tool") -> None:
    """Each override key=value, and none of `reserved` (the keys the tool sets for each run itself:
    the user's would be replaced, or would replace what the tool relies on)."""
    for override in overrides:
        key, equals, _ = override.partition("=")
        key = key.lstrip("+~").strip()
        if not key or not (equals or override.startswith("~")):  # ~key deletes a key, as Hydra has it
            parser.error(f"{override!r}: overrides are key=value")
        if key in reserved:
            parser.error(f"{key} is set by {who} itself (reserved: {', '.join(reserved)})")


def load_config(parser: argparse.ArgumentParser, overrides: Sequence[str], config_name: str = "default",
                what: str = "") -> Any:
    """The overrides composed and validated as a run will (asyncgrpo.config.load), or parser.error
    with the ConfigError's line, after `what` (e.g. the mode the overrides are for). The "your model"
    profile's note is not printed here: the run prints it."""
    from asyncgrpo.config import load
    from asyncgrpo.schema import ConfigError

    try:
        return load(list(overrides), config_name=config_name, log=lambda line: None)
    except ConfigError as err:
        parser.error(f"{what}: {err}" if what else str(err))


def fresh_dir(root: str | Path) -> Path:
    """A new folder root/<date-time> (with -2, -3, ... if one of that second exists), created."""
    base = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            k += 1
            path = base.with_name(f"{base.name}-{k}")
