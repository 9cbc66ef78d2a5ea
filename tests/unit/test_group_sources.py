"""`GroupSource` (asyncgrpo/queue/sources.py) is the whole interface between a group source and the
learner: each source implements every member with the Protocol's signature, and the learner calls
nothing on its source that the Protocol does not name (read from the learner's code, so a new call
fails here until the Protocol and every source have it)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from asyncgrpo.queue.replay_queue import ReplayQueue
from asyncgrpo.queue.sources import GroupSource, ListSource
from asyncgrpo.recording.source import RecordedSource

PACKAGE = Path(__file__).resolve().parents[2] / "asyncgrpo"
# Every module that holds or is handed the learner's source.
LEARNER_CODE = sorted((PACKAGE / "learner").glob("*.py")) + [PACKAGE / "driver" / "replay.py"]
SOURCE_ATTRIBUTE = re.compile(r"_?source")  # learner.source, self.source, a collaborator's self._source


def protocol_members() -> set[str]:
    return {name for name in vars(GroupSource) if not name.startswith("_")}


def test_the_protocol_names_the_members_the_learner_needs():
    assert protocol_members() == {"depth", "take", "stats", "generator_down", "rejoin", "state_dict",
                                  "load_state_dict", "close", "set_admission_bound"}


@pytest.mark.parametrize("source", [ReplayQueue, ListSource, RecordedSource], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("member", sorted(protocol_members()))
def test_every_source_implements_every_member_with_the_protocols_signature(source, member):
    wanted = inspect.getattr_static(GroupSource, member)
    found = inspect.getattr_static(source, member, None)
    assert found is not None, f"{source.__name__} lacks GroupSource.{member}"
    if isinstance(wanted, property):
        assert isinstance(found, property), f"{source.__name__}.{member} must be a property"
        wanted, found = wanted.fget, found.fget
    assert inspect.signature(found) == inspect.signature(wanted), f"{source.__name__}.{member}"


def annotated_as_source(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters of `function` annotated as a `GroupSource` (or `GroupSource | None`)."""
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return {arg.arg for arg in arguments if arg.annotation is not None and "GroupSource" in ast.unparse(arg.annotation)}


def is_source(node: ast.expr, parameters: set[str]) -> bool:
    """`node` is the learner's source: `<anything>.source`, or a parameter annotated as one."""
    if isinstance(node, ast.Attribute):
        return SOURCE_ATTRIBUTE.fullmatch(node.attr) is not None
    return isinstance(node, ast.Name) and node.id in parameters


def members_used(tree: ast.AST) -> set[str]:
    """Attribute names read on the source anywhere in `tree`, `hasattr(source, "x")`-style looks included."""
    used: set[str] = set()
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    for function in functions:
        parameters = annotated_as_source(function)
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and is_source(node.value, parameters):
                used.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                  and is_source(node.args[0], parameters) and isinstance(node.args[1], ast.Constant)):
                used.add(node.args[1].value)
    return used


def test_the_scan_sees_calls_on_the_source_however_reached():
    code = ("def f(queue: GroupSource | None, other):\n    queue.take(1)\n    other.depth\n"
            "class L:\n    def g(self):\n        self.source.stats()\n        hasattr(self._source, 'extra')\n"
            "        self.weights.push()\n")
    assert members_used(ast.parse(code)) == {"take", "stats", "extra"}


def test_the_learner_calls_nothing_on_its_source_outside_the_protocol():
    used = {path.name: members_used(ast.parse(path.read_text(), str(path))) for path in LEARNER_CODE}
    outside = {name: sorted(members - protocol_members()) for name, members in used.items() if members - protocol_members()}
    assert not outside, f"add these to GroupSource (asyncgrpo/queue/sources.py) and every source: {outside}"
    # Exact: the Protocol names nothing the learner does not use.
    assert set().union(*used.values()) == protocol_members()
