"""`asyncgrpo train [key=value ...]`, `asyncgrpo plot RUN_DIR ...`, `asyncgrpo export CHECKPOINT OUTDIR`,
`asyncgrpo make-model SHAPE OUT_DIR`, `asyncgrpo simulate RUN_DIR [key=value ...]`,
`asyncgrpo replay DIR [key=value ...]`, `asyncgrpo study SPEC [study_dir=DIR] [key=value ...]`: the
command-line entry point."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from asyncgrpo import __version__
from asyncgrpo.config import load
from asyncgrpo.driver.prepare import interrupt_on_sigterm
from asyncgrpo.models.shapes import SHAPES
from asyncgrpo.schema import CONFIG_DIR, Config, ConfigError

# 128 + SIGINT, as a shell reports Ctrl-C; an interrupted study run reports it too (study.EXIT_INTERRUPTED).
EXIT_INTERRUPTED = 130

USAGE_EXAMPLES = """examples:
  asyncgrpo train                                    # the embedded default (CPU, tiny model)
  asyncgrpo train train.max_steps=20 train.max_staleness=0 run_dir=runs/sync seed=3
  asyncgrpo train log.tensorboard=true log.samples_every_steps=50
  asyncgrpo train --config-name default --cfg        # print the resolved config and exit
  asyncgrpo plot runs/a runs/b --out plots_ab        # compare runs
  asyncgrpo train train.save_every_steps=100         # sharded checkpoints in run_dir/checkpoints
  asyncgrpo train resume=runs/a                      # continue from its newest complete checkpoint
  asyncgrpo train run_dir=runs/a resume=auto         # the same, or a fresh start if it has none (restarts)
  asyncgrpo export runs/a/checkpoints/step_100 hf    # a checkpoint in Hugging Face format
  asyncgrpo export runs/l adapter --merged hf       # a LoRA run: PEFT adapter dir, and the merged model
  asyncgrpo make-model qwen2.5-0.5b models/q05b      # a random Qwen2.5-0.5B-shaped model (docs/MODELS.md)
  asyncgrpo train wire.record_dir=rec/a              # keep every group the learner consumes
  asyncgrpo replay rec/a algo.mode=decoupled         # train on that stream again, no generators
  asyncgrpo simulate runs/a rollout.num_generators=4 # predicted samples/s, idle, staleness (docs/SIMULATOR.md)
  asyncgrpo study configs/studies/quick.yaml study_dir=studies/q  # a grid x seeds, with a report (docs/STUDIES.md)
"""

# Hydra's own command line has these; `asyncgrpo train` is not Hydra's app, so each gets one line
# naming what it has instead.
HYDRA_CFG_KINDS = ("job", "hydra", "all")
CFG_TAKES_NO_ARGUMENT = ("--cfg takes no argument (Hydra's --cfg job|hydra|all): asyncgrpo train [key=value ...] "
                         "--cfg prints the resolved config")
MULTIRUN_IS_A_STUDY = ("-m/--multirun: sweeps are studies here: asyncgrpo study SPEC runs a grid of overrides x seeds "
                       "(docs/STUDIES.md)")

# One line per config group; a group added to Config without an entry here still gets listed.
GROUP_HELP = {
    "model": "the policy: a Hugging Face directory, or the embedded tiny Qwen2 and its warm start",
    "task": "what the prompts are and how answers are checked",
    "data": "prompt files for file-based tasks (JSONL or Parquet)",
    "reward": "reward terms, user reward functions, an LLM judge",
    "rollout": "vLLM generators: how many, samples per prompt, sampling, placement",
    "learner": "the FSDP2 learner: optimizer, schedule, micro-batching, placement",
    "algo": "GRPO variant: advantages, policy loss, clipping, KL, rollout IS correction",
    "train": "the driver loop: steps, groups per step, the staleness bound",
    "queue": "the replay queue between generators and learner",
    "wire": "ZeroMQ transport: host, CURVE authentication, timeouts",
    "weights": "weight pushes from learner to generators",
    "eval": "held-out evaluation at the start and the end",
    "ray": "the Ray cluster: local or an existing one",
    "log": "metrics sinks (TensorBoard, W&B) and the periodic sample table",
}

# The keys people change most; their defaults are read from Config so this text cannot go stale.
COMMON_KEYS = {
    "run_dir": "where config.yaml, metrics.jsonl, summary.json, samples.jsonl go",
    "seed": "",
    "device": "auto | cpu | cuda",
    "model.path": "empty = the embedded tiny model; set: the 'your model' profile for toy values left unset",
    "task.name": "arithmetic | countdown | longtail | gsm8k | files (docs/TASKS.md)",
    "data.train_files": "JSONL or Parquet prompt files, for task.name=gsm8k|files",
    "data.prompt_field": "record field holding the prompt",
    "data.answer_field": "record field holding the reference answer",
    "reward.terms": "weighted rewards, e.g. [{name:math,weight:1.0},{name:fmt,kind:format,weight:0.1}]",
    "reward.fn": "a user reward function, package.module:function",
    "reward.on_error": "drop_group | zero: what a failing reward does",
    "train.max_steps": "learner steps (policy versions)",
    "train.groups_per_step": "prompt groups per learner step",
    "train.max_staleness": "policy versions; 0 = synchronous on-policy GRPO",
    "train.stale_policy": "throttle | drop | both",
    "rollout.samples_per_prompt": "completions per prompt (the group size)",
    "rollout.num_generators": "",
    "rollout.inflight_updates": "load pushed weights between engine steps while sequences run",
    "learner.lr": "AdamW learning rate (after learner.warmup_steps)",
    "learner.world_size": "FSDP2 learner ranks",
    "learner.micro_batch_tokens": "padded tokens per forward pass per rank; 0 = whole share",
    "learner.mini_batches": "optimizer steps per learner step, each on a share of its groups",
    "weights.backend": "zmq (any device) | nccl (GPU broadcast)",
    "algo.mode": "bypass | decoupled | naive: the PPO anchor (docs/ALGORITHMS.md)",
    "algo.loss_type": "",
    "algo.clip_low": "",
    "algo.clip_high": "",
    "log.tensorboard": "event files under run_dir/tensorboard",
    "log.wandb": "W&B run under run_dir/wandb",
    "log.wandb_mode": "offline needs no network",
    "log.samples_every_steps": "print and keep a few completions; 0 = off",
}


def _format_default(value: Any) -> str:
    """As it would be written on the command line (YAML spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return "''"
    return str(value)


def _group_description(cls: Any) -> str:
    # A dataclass without a docstring gets a generated signature as __doc__; that is not a description.
    doc = (cls.__doc__ or "").strip()
    return "" if not doc or doc.startswith(cls.__name__ + "(") else doc.splitlines()[0]


def config_help() -> str:
    """The config groups and the most-used keys with their current defaults, from `Config` itself."""
    defaults = Config()
    groups = [(f.name, type(getattr(defaults, f.name))) for f in dataclasses.fields(Config)
              if dataclasses.is_dataclass(getattr(defaults, f.name))]
    width = max(len(name) for name, _ in groups) + 3
    lines = ["config groups (`asyncgrpo train --cfg` prints every key; defaults live in asyncgrpo/schema.py):"]
    lines += [f"  {name + '.*':<{width}} {GROUP_HELP.get(name) or _group_description(cls)}".rstrip()
              for name, cls in groups]
    lines.append("most-used keys, with their defaults:")
    entries = []
    for key, description in COMMON_KEYS.items():
        value: Any = defaults
        try:
            for part in key.split("."):
                value = getattr(value, part)
        except AttributeError:
            continue  # a key renamed in Config; test_cli_help catches it
        entries.append((f"{key}={_format_default(value)}", description))
    key_width = max(len(entry) for entry, _ in entries) + 2
    lines += [f"  {entry:<{key_width}}{description}".rstrip() for entry, description in entries]
    presets = sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))
    if presets:
        lines.append(f"presets (--config-name NAME, in {CONFIG_DIR}): {', '.join(presets)}")
    return "\n".join(lines) + "\n"


def _check(cfg: Config) -> int:
    """check=true: the preflight report (asyncgrpo/driver/preflight.py), or the one-line reason it fails."""
    from asyncgrpo.models.check import ModelDirError
    from asyncgrpo.driver.preflight import (
        PreflightError,
        check_data,
        check_rewards,
        format_report,
        model_dir_for_check,
        preflight,
    )
    from asyncgrpo.config import set_resolved_device
    from asyncgrpo.driver.prepare import resolve_device

    try:
        set_resolved_device(cfg, resolve_device(cfg.device))
    except ConfigError as err:
        return _config_error(str(err))
    try:
        rewards = check_rewards(cfg)
        with model_dir_for_check(cfg) as model_dir:
            report = {**preflight(cfg, model_dir), "reward": rewards}
            report["data"] = check_data(cfg, model_dir)
    except (ModelDirError, PreflightError) as err:
        print(f"asyncgrpo: check failed: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(json.dumps(report, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`asyncgrpo` with `argv` (default: sys.argv[1:]): the command's exit status."""
    # A process started in the background by a non-interactive shell inherits "ignore SIGINT";
    # Ctrl-C (or a supervisor's SIGINT) must always reach the driver so it can shut down cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_on_sigterm()  # SIGTERM (a scheduler's preemption notice) is handled as Ctrl-C
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if _names_a_hydra_cfg_kind(argv):
        return _config_error(CFG_TAKES_NO_ARGUMENT)
    args = _parse_args(parser, argv)
    return COMMANDS[args.command](args)


# argparse has no public name for what add_subparsers returns.
_Subcommands = argparse._SubParsersAction


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: --version and one subcommand per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="asyncgrpo", description="Asynchronous off-policy GRPO.", epilog=USAGE_EXAMPLES + "\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asyncgrpo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_parser in (_add_train_parser, _add_plot_parser, _add_export_parser, _add_make_model_parser,
                       _add_simulate_parser, _add_replay_parser, _add_study_parser):
        add_parser(commands)
    return parser


def _add_train_parser(commands: _Subcommands) -> None:
    train_parser = commands.add_parser(
        "train", help="run a training job (key=value overrides)", epilog=USAGE_EXAMPLES + "\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a training job; any config key can be overridden as key=value.",
    )
    train_parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    train_parser.add_argument("--config-name", default="default", help="a YAML file in --config-dir (default: default)")
    train_parser.add_argument("--config-dir", default=None, help="directory of YAML presets (default: the repo's configs/)")
    train_parser.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    train_parser.add_argument("-m", "--multirun", action="store_true",
                              help="not here: a sweep is a study (asyncgrpo study, docs/STUDIES.md)")


def _add_plot_parser(commands: _Subcommands) -> None:
    plot_parser = commands.add_parser(
        "plot", help="write PNG figures of one run, or overlay several",
        description="Figures from RUN_DIR/metrics.jsonl and summary.json: reward and held-out accuracy over samples "
                    "and wall-clock, staleness, IS weights and mismatch, throughput and idle fractions, and the "
                    "trained-vs-sampled audit.",
    )
    plot_parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories; several are overlaid")
    plot_parser.add_argument("--out", default=None,
                             help="output directory (default: RUN_DIR/plots for one run, ./plots_compare for several)")


def _add_export_parser(commands: _Subcommands) -> None:
    export_parser = commands.add_parser(
        "export", help="write a checkpoint's policy in Hugging Face format",
        description="Safetensors + config + tokenizer files that transformers and vLLM load directly. CHECKPOINT is "
                    "a checkpoint directory (step_<N>) or a run directory (its newest complete checkpoint).",
    )
    export_parser.add_argument("checkpoint", metavar="CHECKPOINT")
    export_parser.add_argument("outdir", metavar="OUTDIR")
    export_parser.add_argument("--merged", metavar="DIR", default=None,
                               help="a LoRA checkpoint: OUTDIR gets the PEFT adapter directory, DIR the merged model")


def _add_make_model_parser(commands: _Subcommands) -> None:
    make_model_parser = commands.add_parser(
        "make-model", help="write a randomly initialised Hugging Face model of a named shape",
        description="A Qwen2 model of a real architecture's shape with random float32 weights and a byte-level BPE "
                    "tokenizer trained locally (chat template, eos/pad ids); transformers and vLLM load it as it is. "
                    "For exercising the machinery at real sizes, not for learning (docs/MODELS.md).",
    )
    make_model_parser.add_argument("shape", metavar="SHAPE", help=f"one of: {', '.join(SHAPES)}")
    make_model_parser.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty directory")
    make_model_parser.add_argument("--seed", type=int, default=0, help="weights and tokenizer corpus (default: 0)")
    make_model_parser.add_argument("--vocab-train-size", type=int, default=None, metavar="N",
                                   help="tokens in the trained tokenizer, special tokens included (default: "
                                        "asyncgrpo.models.bpe.DEFAULT_VOCAB_SIZE = 4096)")


def _add_simulate_parser(commands: _Subcommands) -> None:
    simulate_parser = commands.add_parser(
        "simulate", help="predict throughput, idle fractions and staleness for other settings of a finished run",
        description="A discrete-event model of the generators, the queue, the learner and weight pushes, calibrated "
                    "from RUN_DIR's measured phase times (docs/SIMULATOR.md). Prints a table, then one JSON line.",
        epilog="keys: " + ", ".join(_simulate_keys()) + "\nexample: asyncgrpo simulate runs/a rollout.num_generators=8 "
               "train.max_staleness=2 learner.world_size=4 sim.scaling_efficiency=0.9 sim.steps=200",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate_parser.add_argument("run_dir", metavar="RUN_DIR")
    simulate_parser.add_argument("overrides", nargs="*", help="key=value (the keys below)")


def _add_replay_parser(commands: _Subcommands) -> None:
    replay_parser = commands.add_parser(
        "replay", help="train a learner on a recorded stream (wire.record_dir), no generators",
        description="Train on the groups a run recorded (wire.record_dir=DIR), step by step at the versions that "
                    "took them, from that run's starting weights, with its config and these overrides (e.g. "
                    "algo.mode=decoupled, algo.correction.is_level=token, seed=1). Writes run_dir (default "
                    "DIR/replay-<time>): config.yaml, metrics.jsonl, summary.json. On CPU the same recording, "
                    "config and seed give identical losses.",
    )
    replay_parser.add_argument("recording", metavar="DIR", help="a wire.record_dir of an earlier run")
    replay_parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")


def _add_study_parser(commands: _Subcommands) -> None:
    study_parser = commands.add_parser(
        "study", help="run a grid of configs x seeds one after another, then report means and intervals",
        description="Every cell of SPEC's grid at every seed, as `asyncgrpo train` runs one after another into "
                    "study_dir/runs/<cell>/seed_<s> (default study_dir: studies/<name>); finished runs are skipped "
                    "when the command is run again; Ctrl-C stops the current run and still writes the results. "
                    "Writes results.csv, report.md (per-cell means with 95% intervals, paired differences against "
                    "the spec's baseline) and plots/. The spec is checked, every cell's config composed, before any "
                    "run. SPEC is a YAML file or the name of one in configs/studies/ (docs/STUDIES.md).",
    )
    study_parser.add_argument("spec", metavar="SPEC", help="a study spec (YAML), or a name in configs/studies/")
    study_parser.add_argument("overrides", nargs="*",
                              help="study_dir=DIR, and key=value overrides added to the spec's base for every run")
    study_parser.add_argument("--dry-run", action="store_true",
                              help="check the spec, list the runs and which are finished; run nothing")
    study_parser.add_argument("--report-only", action="store_true",
                              help="rewrite results.csv, report.md and plots/ from the runs so far; run nothing")
    study_parser.add_argument("--fresh-engines", action="store_true",
                              help="every run starts its own Ray cluster and vLLM engines (default: the study starts "
                                   "one Ray cluster and the runs keep the generator engines between them)")
    study_parser.add_argument("--concurrent", type=int, default=1, metavar="N",
                              help="N runs at a time (on a Ray cluster with room for them: ray.address in the spec's "
                                   "base, or the study's own cluster sized for N runs; default 1)")


def _names_a_hydra_cfg_kind(argv: list[str]) -> bool:
    """`train --cfg job` or `--cfg=all`: Hydra's spelling, which this --cfg does not take."""
    return argv[:1] == ["train"] and any(arg.startswith("--cfg=") or (arg == "--cfg" and following in HYDRA_CFG_KINDS)
                                         for arg, following in zip(argv, [*argv[1:], ""]))


def _parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed command line; argparse's error (exit 2) for an argument no command takes."""
    args, extra = parser.parse_known_args(argv)
    # argparse fills a `nargs="*"` positional once: overrides on both sides of an option
    # (`train a=1 --cfg b=2`) would leave the second part "unrecognized".
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _study(args: argparse.Namespace) -> int:
    """`asyncgrpo study`: asyncgrpo/study/runner.py's command, with the flags as its options."""
    from asyncgrpo.study.runner import command as study_command

    return study_command(args.spec, args.overrides, dry_run=args.dry_run, report_only=args.report_only,
                         keep_engines=not args.fresh_engines, concurrent=args.concurrent)


def _train(args: argparse.Namespace) -> int:
    """`asyncgrpo train`: compose the config, then print it (--cfg), check it (check=true) or run it."""
    if args.multirun:
        return _config_error(MULTIRUN_IS_A_STUDY)
    try:
        # The profile's note: stdout beside the run's other notes, stderr under --cfg (stdout is the YAML).
        cfg = load(args.overrides, config_name=args.config_name, config_dir=args.config_dir,
                   log=None if args.cfg else (lambda line: print(line, flush=True)))
        if not args.cfg:
            from asyncgrpo.metrics import require_sink_packages

            require_sink_packages(cfg.log)
    except ConfigError as err:
        print(f"asyncgrpo: config error: {err}", file=sys.stderr)
        return 2
    _warn_inert_settings(cfg)
    if args.cfg:
        from asyncgrpo.schema import to_yaml

        print(to_yaml(cfg))
        return 0
    if cfg.check:
        return _check(cfg)
    return _run_training(cfg)


def _warn_inert_settings(cfg: Config) -> None:
    """One line naming the changed settings this run does not read (asyncgrpo/inert_settings.py)."""
    from asyncgrpo.inert_settings import inert_settings

    inert = inert_settings(cfg)
    if inert:
        print(f"asyncgrpo: warning: set but not read by this run: {'; '.join(inert)}", file=sys.stderr, flush=True)


def _run_training(cfg: Config) -> int:
    """train(cfg): a failure as one line (a traceback only for the unexpected) and its exit status,
    a finished run as one JSON line of its summary."""
    from asyncgrpo.data.records import DataError
    from asyncgrpo.driver import TrainingFailed
    from asyncgrpo.learner.checkpoint import CheckpointError
    from asyncgrpo.models.check import ModelDirError
    from asyncgrpo.driver.preflight import PreflightError
    from asyncgrpo.learner.resume import ResumeRefused
    from asyncgrpo.train import train

    try:
        summary = train(cfg)
    except DataError as err:  # bad or missing data: the message names the file and line
        print(f"asyncgrpo: data error: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, ResumeRefused) as err:  # no usable checkpoint, a tampered one, or another run's
        print(f"asyncgrpo: resume: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # checked only once Ray is up: node resources, where the actors landed
        print(f"asyncgrpo: config error: {err}", file=sys.stderr)
        return 2
    except (ModelDirError, PreflightError) as err:  # the model or the settings cannot work: one line
        print(f"asyncgrpo: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asyncgrpo: interrupted; metrics and summary are in {cfg.run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TrainingFailed as err:  # its message is the whole reason, on one line: a traceback adds nothing
        print(f"asyncgrpo: training failed: {type(err).__name__}: {err} (run_dir: {cfg.run_dir})", file=sys.stderr)
        return 1
    except Exception as err:
        traceback.print_exc()
        reason = str(err).splitlines()[0] if str(err) else ""
        print(f"asyncgrpo: training failed: {type(err).__name__}: {reason} (run_dir: {cfg.run_dir})", file=sys.stderr)
        return 1
    keys = ("steps", "samples", "wall_s", "samples_per_s", "eval_accuracy_start", "eval_accuracy_end",
            "groups_dropped_stale", "staleness_max", "run_dir")  # the last line names where it all is
    print(json.dumps({k: summary.get(k) for k in keys}))
    return 0


def _config_error(message: str) -> int:
    print(f"asyncgrpo: config error: {message}", file=sys.stderr)
    return 2


def _plot(run_dirs: list[str], out: str | None) -> int:
    from asyncgrpo.metrics.runs import RunReadError
    from asyncgrpo.plot import plot_runs

    try:
        paths = plot_runs(run_dirs, out)
    except (FileNotFoundError, RunReadError) as err:
        print(f"asyncgrpo: plot: {err}", file=sys.stderr)
        return 2
    except (FileExistsError, NotADirectoryError) as err:  # --out (or a folder above it) is a file
        blocking = Path(err.filename or out or ".")
        while not blocking.exists() and blocking != blocking.parent:  # the error names the path it was making
            blocking = blocking.parent
        print(f"asyncgrpo: plot: --out: {blocking} is a file, not a directory", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _export(checkpoint: str, outdir: str, merged: str | None = None) -> int:
    from asyncgrpo.learner.export import export_checkpoint
    from asyncgrpo.learner.checkpoint import CheckpointError

    try:
        path = export_checkpoint(checkpoint, outdir, merged)
    except (CheckpointError, FileNotFoundError, FileExistsError) as err:
        print(f"asyncgrpo: export: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _simulate_keys() -> list[str]:
    from asyncgrpo.sim.settings import OVERRIDE_KEYS

    return list(OVERRIDE_KEYS)


def _simulate(run_dir: str, overrides: list[str]) -> int:
    from asyncgrpo.sim.report import run_command
    from asyncgrpo.sim.settings import SimulationError

    try:
        print(run_command(run_dir, overrides))
    except SimulationError as err:
        print(f"asyncgrpo: simulate: {err}", file=sys.stderr)
        return 2
    return 0


def _replay(directory: str, overrides: list[str]) -> int:
    from asyncgrpo.learner.checkpoint import CheckpointError
    from asyncgrpo.recording import RecordingError
    from asyncgrpo.driver.replay import replay

    try:
        summary = replay(directory, overrides)
    except ConfigError as err:
        print(f"asyncgrpo: config error: {err}", file=sys.stderr)
        return 2
    except (RecordingError, CheckpointError) as err:  # missing, empty, corrupted, another format, gone weights
        print(f"asyncgrpo: replay: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncgrpo: interrupted; metrics and summary are in the replay's run_dir", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps({k: summary.get(k) for k in ("run_dir", "steps", "samples", "wall_s", "torn_tail_records")}))
    return 0


def _make_model(shape: str, out_dir: str, seed: int, vocab_train_size: int | None) -> int:
    import time

    from asyncgrpo.models.shapes import make_model

    start = time.monotonic()
    try:
        made = make_model(shape, out_dir, seed=seed,
                          **({} if vocab_train_size is None else {"vocab_train_size": vocab_train_size}))
    except (FileExistsError, ValueError) as err:
        print(f"asyncgrpo: make-model: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"path": str(made.path), "shape": made.shape, "parameters": made.num_parameters,
                      "tokenizer_size": made.tokenizer_size, "wall_s": round(time.monotonic() - start, 1)}))
    return 0


# One handler per subcommand of build_parser: the parsed command line in, the exit status out.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train,
    "plot": lambda args: _plot(args.run_dirs, args.out),
    "export": lambda args: _export(args.checkpoint, args.outdir, args.merged),
    "make-model": lambda args: _make_model(args.shape, args.out_dir, args.seed, args.vocab_train_size),
    "simulate": lambda args: _simulate(args.run_dir, args.overrides),
    "replay": lambda args: _replay(args.recording, args.overrides),
    "study": _study,
}


def entry() -> NoReturn:
    """The console script (`asyncgrpo`) and `python -m asyncgrpo.cli`: main(), exiting with its status."""
    code = main()
    if code == EXIT_INTERRUPTED:
        # CPython remembers a KeyboardInterrupt that escaped Python code run by a C extension
        # (PyRun_*), even one caught later, and after a normal exit kills the process with SIGINT
        # instead: status -2 where 130 was meant (seen when SIGTERM landed in the warm start's
        # imports, about 1 in 15). Run what interpreter exit would, then leave with our status.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
