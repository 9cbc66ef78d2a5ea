"""What a checkpoint keeps of the learner's group source: the replay queue's state under the meta's
`states["queue"]`, and nothing (no key) for an offline source, whose `state_dict()` is {}; a
checkpoint without the key loads as {}. Real `checkpoint.save` and `load` on a small state; no
process group, no model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgrpo.config import load
from asyncgrpo.learner import checkpoint
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import outside_sections
from asyncgrpo.queue.sources import ListSource

# DCP without a process group says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Policy:
    """What a checkpoint takes from the policy, reduced to one tensor and a schedule position."""

    def __init__(self) -> None:
        self.weight = torch.ones(3)

    def state_dict(self) -> dict[str, Any]:
        return {"model": {"weight": self.weight.clone()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight = state["model"]["weight"]

    def schedule_state_dict(self) -> dict[str, Any]:
        return {"last_epoch": 0}

    def load_schedule_state_dict(self, state: dict[str, Any]) -> None:
        pass


class StatefulSource(ListSource):
    """An offline source that keeps something, as the replay queue does, and remembers what it loaded."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__([])
        self.state: dict[str, Any] = state
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def learner(tmp_path: Path, source: ListSource) -> Learner:
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "dtype": "float32"}))
    cfg = load([f"run_dir={tmp_path / 'run'}"])
    return Learner(cfg, Policy(), str(model_dir), 0, rank=0, world_size=1, source=source, registry=None,
                   weights=None, owns_process_group=False, **outside_sections(cfg))


def test_an_offline_source_leaves_no_queue_state_in_the_checkpoint(tmp_path):
    saved = learner(tmp_path, ListSource([])).save_checkpoint(tmp_path / "checkpoints")
    assert "queue" not in checkpoint.read_meta(saved)["states"]
    resumed = StatefulSource({"left": "untouched"})
    learner(tmp_path, resumed).load_checkpoint(saved)
    assert resumed.loaded == {}  # a checkpoint without the key loads as an empty state


def test_a_source_with_state_keeps_it_in_the_checkpoint(tmp_path):
    saved = learner(tmp_path, StatefulSource({"counters": {"queue/received": 4}})).save_checkpoint(tmp_path / "ck")
    assert checkpoint.read_meta(saved)["states"]["queue"] == {"counters": {"queue/received": 4}}
    resumed = StatefulSource({})
    learner(tmp_path, resumed).load_checkpoint(saved)
    assert resumed.loaded == {"counters": {"queue/received": 4}}
