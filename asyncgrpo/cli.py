"""`asyncgrpo train [key=value ...]`: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback

from asyncgrpo.config import ConfigError, load

USAGE_EXAMPLES = """examples:
  asyncgrpo train                                    # the embedded default (CPU, tiny model)
  asyncgrpo train train.max_steps=20 train.max_staleness=0 run_dir=runs/sync seed=3
  asyncgrpo train --config-name default --cfg        # print the resolved config and exit

config groups (see asyncgrpo/config.py for every key and its default):
  model.*  task.*  rollout.*  learner.*  algo.*  train.*  queue.*  wire.*  weights.*  eval.*  ray.*
most-used keys:
  train.max_steps=1200  train.groups_per_step=16  train.max_staleness=2  rollout.samples_per_prompt=8
  learner.lr=0.0001  algo.clip_low=0.2  algo.clip_high=0.28  run_dir=runs/<time>  seed=0
"""


def main(argv: list[str] | None = None) -> int:
    # A process started in the background by a non-interactive shell inherits "ignore SIGINT";
    # Ctrl-C (or a supervisor's SIGINT) must always reach the driver so it can shut down cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(prog="asyncgrpo", description="Asynchronous off-policy GRPO.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser(
        "train", help="run a training job", epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    train_parser.add_argument("--config-name", default="default", help="a YAML file in --config-dir (default: default)")
    train_parser.add_argument("--config-dir", default=None, help="directory of YAML presets (default: the repo's configs/)")
    train_parser.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)

    try:
        cfg = load(args.overrides, config_name=args.config_name, config_dir=args.config_dir)
    except ConfigError as err:
        print(f"asyncgrpo: config error: {err}", file=sys.stderr)
        return 2
    if args.cfg:
        from asyncgrpo.config import to_yaml

        print(to_yaml(cfg))
        return 0

    from asyncgrpo.train import train

    try:
        summary = train(cfg)
    except KeyboardInterrupt:
        print(f"asyncgrpo: interrupted; metrics and summary are in {cfg.run_dir}", file=sys.stderr)
        return 130
    except Exception as err:
        traceback.print_exc()
        print(f"asyncgrpo: training failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
              file=sys.stderr)
        return 1
    keys = ("steps", "samples", "wall_s", "samples_per_s", "eval_accuracy_start", "eval_accuracy_end",
            "groups_dropped_stale", "staleness_max")
    print(json.dumps({k: summary.get(k) for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
