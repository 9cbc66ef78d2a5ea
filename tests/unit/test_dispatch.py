"""Tickets (asyncgrpo/queue/dispatch.py): the staleness bound, exactly-once prompts and liveness for any
number of generators at any relative speeds, with deaths, losses in transit, late grants and drops;
the same under fixed staleness, where every step past the warm-up is sampled by exactly one version;
then the small cases by hand."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from one_line import raises_one_line
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncgrpo.contract import Ticket, admission_limit, check_admission_bound
from asyncgrpo.queue.dispatch import Dispatcher


@dataclass
class Gen:
    """One generator process as rollout/tickets.py's client behaves: it asks with a report, counts
    only the answer to its newest request, and repeats its give-backs until a request carrying
    them is answered."""

    index: int
    incarnation: int = 0
    loaded: int = 0
    requests: int = 0
    answer: tuple[int, list[Ticket], list[int]] | None = None  # (grant, tickets, give-backs it carried) on its way
    newest_grant: int = 0
    unsent: list[tuple[Ticket, int]] = field(default_factory=list)  # (ticket, version it was granted with)
    given_back: set[int] = field(default_factory=set)  # positions not to be sent, until a request carrying them is answered
    in_transit: list[tuple[tuple[int, int], int]] = field(default_factory=list)  # (holder, position) sent, not arrived

    @property
    def holder(self) -> tuple[int, int]:
        return self.index, self.incarnation

    def report(self, wanted: int) -> tuple:
        """`Dispatcher.request`'s arguments for a request of this process now."""
        return (self.holder, self.loaded, wanted, self.newest_grant, [t.position for t, _ in self.unsent],
                sorted(self.given_back))


class World:
    """Generators, the wire between them and the dispatcher, and the learner, driven one event at a time."""

    def __init__(self, generators: int, groups_per_step: int, max_staleness: int, fixed_staleness: bool = False,
                 first_step: int = 0) -> None:
        """`fixed_staleness`: the learner at version v publishes version v - max_staleness (none newer
        than the starting weights `first_step` before that). `step` takes and trains at once, so this
        is learner/publication.py's rule: v + 1 - k published once step v is taken."""
        self.d = Dispatcher(groups_per_step, max_staleness, first_step=first_step, fixed_staleness=fixed_staleness)
        self.fixed, self.first_step, self.max_staleness = fixed_staleness, first_step, max_staleness
        self.gens = [Gen(i, loaded=first_step) for i in range(generators)]
        self.version = first_step  # the learner's
        self.sampled: list[tuple[int, int]] = []  # (step trained at, version that sampled the group)
        # (holder, position) -> version at grant: a ticket keeps its prompt, its slot may move
        self.granted_version: dict[tuple[tuple[int, int], int], int] = {}
        self.trained: list[int] = []  # positions, in training order
        self.staleness: list[int] = []
        self.dropped_for_good: set[int] = set()  # positions given back (their rewards failed): not retried
        self.late: list[tuple] = []  # requests dead processes sent, read after the driver reported the death
        self.early = 0  # groups trained at an earlier step than the slot they were granted

    def ask(self, g: Gen, wanted: int) -> None:
        # The request travels on the groups' ordered stream: what is in transit arrives first. Its
        # answer replaces any older one still on its way (the client ignores those when they come).
        while g.in_transit:
            self.arrive(g)
        g.requests += 1
        arguments = g.report(wanted)
        number, tickets = self.d.request(*arguments)
        for ticket in tickets:
            self.granted_version[(g.holder, ticket.position)] = g.loaded
        g.answer = (number, tickets, arguments[-1])

    def lose_grant(self, g: Gen) -> None:  # the answer is lost, or comes after the client stopped waiting
        g.answer = None

    def deliver(self, g: Gen) -> None:
        if g.answer is not None:
            (number, tickets, carried), g.answer = g.answer, None
            g.given_back.difference_update(carried)
            if tickets:
                g.newest_grant = number
                g.unsent += [(t, self.granted_version[(g.holder, t.position)]) for t in tickets]

    def send(self, g: Gen, lose: bool = False) -> None:
        if g.unsent:
            ticket, _ = g.unsent.pop(0)
            if not lose:
                g.in_transit.append((g.holder, ticket.position))

    def arrive(self, g: Gen) -> None:
        # A group names its prompt's position; the slot is the one its sender holds for it, if any.
        if g.in_transit:
            holder, position = g.in_transit.pop(0)
            slot = self.d.slot_of(holder, position)
            if slot is not None:
                assert self.d.arrived(holder, slot)

    def give_back(self, g: Gen) -> None:  # reward.on_error=drop_group: the prompt is not retried
        if g.unsent:
            ticket, _ = g.unsent.pop(0)
            g.given_back.add(ticket.position)
            self.dropped_for_good.add(ticket.position)

    def die(self, g: Gen, wanted: int) -> None:
        # Its last request may still be on the stream when the driver reports the death.
        self.late.append(g.report(wanted))
        self.d.generator_down(g.index, g.incarnation)
        g.incarnation += 1
        g.loaded, g.requests, g.answer, g.newest_grant, g.unsent, g.given_back = self.published, 0, None, 0, [], set()
        # What the dead process sent may still arrive, under its old name: in_transit is kept.

    def read_late(self) -> None:
        if self.late:
            assert self.d.request(*self.late.pop(0)) == (0, [])  # a dead process is granted nothing

    @property
    def published(self) -> int:
        """The newest weights a generator can load."""
        return max(self.first_step, self.version - self.max_staleness) if self.fixed else self.version

    def load(self, g: Gen) -> None:
        g.loaded = max(g.loaded, self.published)

    def ahead(self, g: Gen, versions: int) -> None:
        """Weights newer than the delayed publication reach generator g > 0 (none should: the
        dispatcher must not rely on it). Generator 0 keeps to the publication, so the run can go on."""
        if self.fixed and g.index > 0:
            g.loaded = max(g.loaded, min(self.version, self.published + versions))

    def step(self) -> bool:
        self.early += len(self.d.fill_early())
        if not self.d.ready():
            return False
        for slot, holder, position in self.d.take():
            self.staleness.append(self.version - self.granted_version[(holder, position)])
            self.sampled.append((self.version, self.granted_version[(holder, position)]))
            self.trained.append(position)
        self.version += 1
        return True


EVENTS = ("ask", "deliver", "lose_grant", "send", "lose", "arrive", "give_back", "die", "late", "load", "step")


@settings(max_examples=150, deadline=None)
@given(generators=st.integers(1, 8), groups_per_step=st.integers(1, 8), max_staleness=st.integers(0, 4),
       script=st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 7), st.integers(1, 4)), max_size=400),
       final_wanted=st.lists(st.integers(1, 4), min_size=1, max_size=8))
# A give-back repeated because its answer (which gave the slot again, with a new prompt) was lost.
@example(generators=1, groups_per_step=1, max_staleness=0, final_wanted=[1],
         script=[("ask", 0, 1), ("deliver", 0, 1), ("give_back", 0, 1), ("ask", 0, 1), ("lose_grant", 0, 1),
                 ("ask", 0, 1)])
# Requests of dead processes read after the driver reported the death: one that had asked, one that
# never had, one with a give-back.
@example(generators=2, groups_per_step=2, max_staleness=0, final_wanted=[2],
         script=[("ask", 0, 2), ("die", 0, 2), ("late", 0, 1), ("die", 0, 2), ("late", 0, 1)])
@example(generators=1, groups_per_step=2, max_staleness=1, final_wanted=[3],
         script=[("ask", 0, 2), ("deliver", 0, 1), ("give_back", 0, 1), ("die", 0, 2), ("late", 0, 1)])
def test_any_interleaving_keeps_the_bound_trains_each_prompt_once_and_never_deadlocks(
        generators, groups_per_step, max_staleness, script, final_wanted):
    world = World(generators, groups_per_step, max_staleness)
    drive(world, script)
    finish(world, final_wanted)
    # The bound: every group trained within max_staleness of the weights that started it.
    assert all(0 <= s <= max_staleness for s in world.staleness), world.staleness
    assert_each_prompt_trained_once(world)


def drive(world: World, script: list[tuple[str, int, int]]) -> None:
    """The script's events, one at a time, checking the dispatcher's indexes after each."""
    generators = len(world.gens)
    for event, who, wanted in script:
        g = world.gens[who % generators]
        if event in ("ask", "die", "ahead", "bound"):
            getattr(world, event)(g, wanted)
        elif event == "lose":
            world.send(g, lose=True)
        elif event == "step":
            world.step()
        elif event == "late":
            world.read_late()
        else:
            getattr(world, event)(g)
        # slot_of's indexes agree with the slots held, whatever happened
        world.d.holdings.check()
        # Once its death is reported, a process holds nothing: no step waits on it.
        holders = list(world.d.holdings.holders())
        assert all(holder == world.gens[holder[0]].holder for holder in holders), holders


def finish(world: World, final_wanted: list[int]) -> None:
    """Then everyone behaves: the learner must reach 3 more steps (a lost slot is re-granted once its
    holder reports, a dead holder's at once; nobody waits on a slot no one will fill)."""
    target = world.version + 3
    wanted = itertools.cycle(final_wanted)
    for _ in range(500):
        if world.version >= target:
            break
        for g in world.gens:
            world.load(g)
            world.ask(g, next(wanted))
            world.deliver(g)
            while g.unsent:
                world.send(g)
            while g.in_transit:
                world.arrive(g)
        while world.step():
            pass
    assert world.version >= target, f"stuck at step {world.version}, missing {world.d.missing()}"


def assert_each_prompt_trained_once(world: World) -> None:
    """No prompt trained twice; every prompt handed out was trained, dropped for what it is (given
    back), or is still pending (what a checkpoint would give again)."""
    assert len(world.trained) == len(set(world.trained))
    pending = set(world.d.state_dict()["retry_positions"])
    handed_out = set(range(world.d.state_dict()["next_position"]))
    assert handed_out == set(world.trained) | world.dropped_for_good | pending
    assert not set(world.trained) & pending


class BoundWorld(World):
    """Divergence control: the learner moves the admission bound between grants (event "bound")."""

    def bound(self, g: Gen, value: int) -> None:
        self.d.admission_bound = check_admission_bound(value % (self.max_staleness + 1), self.max_staleness, False)

    def ask(self, g: Gen, wanted: int) -> None:
        limit = admission_limit(g.loaded, self.d.admission_bound, self.d.groups_per_step)
        before = set(self.granted_version)
        super().ask(g, wanted)
        new = [position for holder, position in set(self.granted_version) - before]
        slots = [self.d.slot_of(g.holder, position) for position in new]
        assert all(slot is not None and slot < limit for slot in slots), (slots, limit)


@settings(max_examples=150, deadline=None)
@given(generators=st.integers(1, 8), groups_per_step=st.integers(1, 8), max_staleness=st.integers(1, 4),
       script=st.lists(st.tuples(st.sampled_from((*EVENTS, "bound")), st.integers(0, 7), st.integers(0, 4)),
                       max_size=400),
       final_wanted=st.lists(st.integers(1, 4), min_size=1, max_size=8), final_bound=st.integers(0, 4))
def test_a_bound_moved_between_grants_grants_within_it_keeps_max_staleness_trains_each_prompt_once_and_never_deadlocks(
        generators, groups_per_step, max_staleness, script, final_wanted, final_bound):
    world = BoundWorld(generators, groups_per_step, max_staleness)
    drive(world, [(event, who, max(1, n) if event != "bound" else n) for event, who, n in script])
    world.bound(world.gens[0], final_bound)  # the learner keeps whatever bound it ended at
    finish(world, final_wanted)
    # Slots granted under a higher bound stay trainable: every group within max_staleness, none dropped.
    assert all(0 <= s <= max_staleness for s in world.staleness), world.staleness
    assert_each_prompt_trained_once(world)


def test_a_lowered_bound_grants_only_within_it_and_keeps_slots_granted_under_the_higher_one():
    d = Dispatcher(groups_per_step=1, max_staleness=3)
    _, early = d.grant((0, 0), 0, 10)
    assert [t.slot for t in early] == [0, 1, 2, 3]  # steps 0 .. 3 for version 0
    d.admission_bound = 1
    assert d.grant((1, 0), 0, 10)[1] == []  # nothing beyond step 0 + 1 for version 0 now
    assert [t.slot for t in d.grant((1, 0), 4, 10)[1]] == [4, 5]  # version 4: steps 4 and 5
    for slot in (0, 1, 2, 3):
        assert d.arrived((0, 0), slot)
    for step in range(4):  # the early grants train, the last at staleness 3 > the bound 1
        d.fill_early()
        assert [slot for slot, _, _ in d.take()] == [step]


def test_an_admission_bound_outside_0_to_max_staleness_or_moved_under_fixed_staleness_is_refused():
    assert check_admission_bound(2, max_staleness=2, fixed_staleness=False) == 2
    with pytest.raises(ValueError, match="admission bound 3"):
        check_admission_bound(3, max_staleness=2, fixed_staleness=False)
    with pytest.raises(ValueError, match="fixed staleness"):
        check_admission_bound(1, max_staleness=2, fixed_staleness=True)


@settings(max_examples=150, deadline=None)
@given(generators=st.integers(1, 6), groups_per_step=st.integers(1, 6), k=st.integers(0, 4),
       first_step=st.integers(0, 5),
       script=st.lists(st.tuples(st.sampled_from((*EVENTS, "ahead")), st.integers(0, 7), st.integers(1, 4)),
                       max_size=400),
       final_wanted=st.lists(st.integers(1, 4), min_size=1, max_size=8))
# Generator 1 holds version 1 (the learner's, unpublished) while step 1 waits (k = 1): it must not
# sample step 1, which is version 0's.
@example(generators=2, groups_per_step=1, k=1, first_step=0, final_wanted=[1],
         script=[("ask", 0, 1), ("deliver", 0, 1), ("send", 0, 1), ("arrive", 0, 1), ("step", 0, 1),
                 ("ahead", 1, 4), ("ask", 1, 4)])
def test_under_fixed_staleness_every_step_past_the_warm_up_is_sampled_by_exactly_k_versions_before_it(
        generators, groups_per_step, k, first_step, script, final_wanted):
    # A run (first_step 0) or a resume (first_step > 0: the checkpoint's weights, at its step).
    world = World(generators, groups_per_step, k, fixed_staleness=True, first_step=first_step)
    drive(world, script)
    finish(world, final_wanted)
    # Steps first_step .. first_step + k by the starting weights, then step u by version u - k only.
    assert all(version == max(first_step, step - k) for step, version in world.sampled), world.sampled
    assert_each_prompt_trained_once(world)


def test_a_generator_is_granted_only_slots_within_max_staleness_of_its_weights():
    d = Dispatcher(groups_per_step=4, max_staleness=1)
    _, tickets = d.grant((0, 0), loaded_version=0, wanted=100)
    assert [t.slot for t in tickets] == list(range(8))  # steps 0 and 1: slot // 4 - 0 <= 1
    assert [t.position for t in tickets] == list(range(8))
    assert d.grant((1, 0), loaded_version=0, wanted=1) == (0, [])  # nothing left within its bound
    _, more = d.grant((1, 0), loaded_version=1, wanted=100)
    assert [t.slot for t in more] == [8, 9, 10, 11]


def test_a_faster_generator_gets_more_of_a_step_instead_of_a_fixed_share():
    d = Dispatcher(groups_per_step=6, max_staleness=0)
    fast, slow = (0, 0), (1, 0)
    _, first_slow = d.grant(slow, 0, 2)
    served = {fast: [], slow: [t.slot for t in first_slow]}
    for _ in range(2):  # the fast one finishes two calls while the slow one is on its first
        served[fast] += [t.slot for t in d.grant(fast, 0, 2)[1]]
    for holder, slots in served.items():
        for slot in slots:
            assert d.arrived(holder, slot)
    assert d.ready() and len(served[fast]) == 4 and len(served[slow]) == 2
    assert [slot for slot, _, _ in d.take()] == list(range(6))


def test_slots_of_a_dead_generator_go_to_others_lowest_first_with_their_prompts():
    d = Dispatcher(groups_per_step=4, max_staleness=0)
    _, dead = d.grant((0, 0), 0, 2)
    _, alive = d.grant((1, 0), 0, 2)
    assert d.arrived((1, 0), alive[0].slot)
    assert d.holder_down((0, 0)) == [0, 1]
    _, again = d.grant((1, 0), 0, 4)
    assert [(t.slot, t.position) for t in again] == [(0, 0), (1, 1)]  # the same prompts, nothing new
    assert not d.arrived((0, 0), 0)  # the dead process's group, arriving late, is refused
    assert d.counts["refused_arrivals"] == 1


def test_a_report_declares_lost_only_slots_from_grants_the_generator_has_received():
    d = Dispatcher(groups_per_step=4, max_staleness=1)
    number, first = d.grant((0, 0), 0, 2)
    later, second = d.grant((0, 0), 0, 2)  # still on its way to the generator
    assert (number, later) == (1, 2)
    assert d.arrived((0, 0), first[0].slot)
    # The report knows grant 1 only: slot 1 of it is neither unsent nor arrived, so lost; grant 2's
    # slots are not judged.
    assert d.heard_from((0, 0), newest_grant=1, unsent=[]) == [first[1].slot]
    assert d.heard_from((0, 0), newest_grant=2, unsent=[t.position for t in second]) == []
    _, regranted = d.grant((1, 0), 0, 1)
    assert regranted == [Ticket(first[1].slot, first[1].position)]


def test_a_released_group_is_regranted_and_its_prompt_retried_only_when_asked():
    d = Dispatcher(groups_per_step=2, max_staleness=0)
    _, tickets = d.grant((0, 0), 0, 2)
    assert d.arrived((0, 0), 0)
    d.release(0)  # dropped (a full queue): a new prompt for the slot
    d.release(1, retry_prompt=True)  # given back while held, its prompt to be tried again
    _, again = d.grant((0, 0), 0, 2)
    assert [(t.slot, t.position) for t in again] == [(0, 1), (1, 2)]
    with pytest.raises(KeyError):
        d.release(5)


def test_without_the_throttle_any_slot_the_queue_can_hold_may_be_granted():
    assert len(Dispatcher(groups_per_step=2, max_staleness=0, throttle=False).grant((0, 0), 0, 50)[1]) == 50
    d = Dispatcher(groups_per_step=2, max_staleness=0, throttle=False, capacity_groups=6)
    assert [t.slot for t in d.grant((0, 0), 0, 50)[1]] == [0, 1, 2, 3, 4, 5]
    for slot in (0, 1):
        d.arrived((0, 0), slot)
    d.take()
    assert [t.slot for t in d.grant((0, 0), 0, 50)[1]] == [6, 7]  # room for two more once step 0 is taken


def test_take_refuses_an_incomplete_step_and_names_the_missing_slots():
    d = Dispatcher(groups_per_step=3, max_staleness=0)
    d.grant((0, 0), 0, 3)
    d.arrived((0, 0), 1)
    assert d.missing() == [0, 2]
    with pytest.raises(RuntimeError, match=r"missing slots \[0, 2\]"):
        d.take()


def test_a_checkpoints_state_resumes_at_its_step_and_gives_untrained_prompts_first():
    d = Dispatcher(groups_per_step=2, max_staleness=1)
    d.grant((0, 0), 0, 4)  # positions 0..3 in slots 0..3
    for slot in (0, 1, 3):
        d.arrived((0, 0), slot)
    d.take()  # step 0 trains positions 0, 1
    state = d.state_dict()
    assert state == {"step": 1, "next_position": 4, "retry_positions": [2, 3]}
    resumed = Dispatcher.from_state(state, groups_per_step=2, max_staleness=1)
    _, tickets = resumed.grant((0, 1), 1, 3)
    assert [(t.slot, t.position) for t in tickets] == [(2, 2), (3, 3), (4, 4)]


def test_no_slot_past_the_last_step_and_no_position_past_the_data_is_granted():
    d = Dispatcher(groups_per_step=2, max_staleness=3, end_step=2, positions_end=5)
    _, tickets = d.grant((0, 0), 0, 100)
    assert [(t.slot, t.position) for t in tickets] == [(0, 0), (1, 1), (2, 2), (3, 3)]  # steps 0 and 1 only
    assert not d.can_grant(5)
    d.release(1)  # dropped: a new prompt for the slot, the data's last
    d.release(2)  # dropped too, and no prompt is left for it
    assert d.prompts_left() and [(t.slot, t.position) for t in d.grant((0, 0), 0, 100)[1]] == [(1, 4)]
    assert not d.prompts_left() and not d.can_grant(0) and d.grant((1, 0), 0, 100) == (0, [])
    d.holder_down((0, 0))  # a prompt to give again is still given, past the data's end
    assert d.prompts_left() and [(t.slot, t.position) for t in d.grant((1, 0), 0, 100)[1]][:1] == [(0, 0)]


def test_a_restored_dispatcher_keeps_its_last_step_and_data_end():
    d = Dispatcher(groups_per_step=2, max_staleness=0, end_step=3, positions_end=7)
    restored = d.restored(d.state_dict())
    assert (restored.end_step, restored.positions_end) == (3, 7)


def test_bad_settings_are_refused_in_one_line():
    with raises_one_line(ValueError, match="groups_per_step=0"):
        Dispatcher(0, 1)
    with raises_one_line(ValueError, match="capacity_groups=3"):
        Dispatcher(4, 1, capacity_groups=3)


def test_a_request_from_a_restarted_process_retires_its_predecessor_whose_late_requests_get_nothing():
    d = Dispatcher(groups_per_step=4, max_staleness=0)
    assert [t.slot for t in d.request((0, 0), 0, 3, 0, [], [])[1]] == [0, 1, 2]
    assert d.arrived((0, 0), 0)
    # Incarnation 1 asks before anyone said incarnation 0 died: 0's slots not arrived go back, lowest first.
    _, tickets = d.request((0, 1), 0, 4, 0, [], [])
    assert [t.slot for t in tickets] == [1, 2, 3]
    assert d.request((0, 0), 0, 4, 1, [1, 2], []) == (0, [])  # a late request of the dead process
    assert d.counts["stale_requests"] == 1 and d.counts["down"] == 2


def test_a_request_reports_before_it_is_granted():
    d = Dispatcher(groups_per_step=2, max_staleness=0)
    _, first = d.request((0, 0), 0, 2, 0, [], [])
    # Received grant 1, sent prompt 0's group (lost: it never arrived), gives back prompt 1 (rewards
    # failed): both slots are granted again at once, slot 0 with its prompt, slot 1 with a new one.
    grant, again = d.request((0, 0), 0, 2, 1, [], [1])
    assert grant == 2 and [(t.slot, t.position) for t in again] == [(0, 0), (1, 2)]
    assert d.counts["lost"] == 1 and d.counts["released"] == 1


def test_a_give_back_repeated_after_its_answer_was_lost_keeps_the_prompt_that_answer_granted():
    d = Dispatcher(groups_per_step=2, max_staleness=0)
    d.request((0, 0), 0, 2, 0, [], [])  # grant 1: slots 0, 1 with prompts 0, 1
    assert d.arrived((0, 0), 0)
    # Prompt 1's rewards failed: given back, and its slot granted again at once in grant 2 with
    # prompt 2, an answer that never reaches the generator.
    assert d.request((0, 0), 0, 1, 1, [], [1]) == (2, [Ticket(1, 2)])
    # So it repeats the give-back of prompt 1, reporting grant 1 as its newest: slot 1 is now grant
    # 2's, which it never received, and prompt 2 must be given again (prompt 1's give-back is done).
    _, again = d.request((0, 0), 0, 1, 1, [], [1])
    assert again == [Ticket(1, 2)]
    assert d.counts["released"] == 1 and d.counts["unreceived"] == 1


def test_after_a_reported_death_a_late_request_of_the_dead_process_gets_nothing_and_the_living_get_its_slots():
    d = Dispatcher(groups_per_step=4, max_staleness=0)
    assert [t.slot for t in d.request((0, 0), 0, 2, 0, [], [])[1]] == [0, 1]
    assert [t.slot for t in d.request((1, 0), 0, 1, 0, [], [])[1]] == [2]
    assert d.generator_down(0, incarnation=0) == [0, 1]
    # A request the dead process sent before it died, read after the driver's report.
    assert d.request((0, 0), 0, 4, 1, [0, 1], []) == (0, [])
    _, tickets = d.request((1, 0), 0, 4, 1, [2], [])
    assert [(t.slot, t.position) for t in tickets] == [(0, 0), (1, 1), (3, 3)]
    assert d.counts["stale_requests"] == 1 and d.counts["down"] == 2
    # Its successor asks as usual and keeps what it gets.
    assert d.request((0, 1), 0, 4, 0, [], []) == (0, [])  # nothing left within the bound, nothing refused
    assert d.counts["stale_requests"] == 1


def test_a_reported_death_covers_a_process_that_never_asked_and_spares_a_newer_one():
    d = Dispatcher(groups_per_step=2, max_staleness=0)
    d.generator_down(0, incarnation=1)  # incarnation 1 died before its first request was read
    assert d.request((0, 1), 0, 2, 0, [], []) == (0, [])
    assert d.request((0, 0), 0, 2, 0, [], []) == (0, [])
    assert [t.slot for t in d.request((0, 2), 0, 1, 0, [], [])[1]] == [0]
    d.generator_down(0, incarnation=1)  # a report about an older process leaves incarnation 2 alone
    assert [t.slot for t in d.request((0, 2), 0, 1, 1, [0], [])[1]] == [1]
    assert d.counts["down"] == 0 and d.counts["stale_requests"] == 2


def test_under_fixed_staleness_a_generator_is_granted_only_the_step_its_weights_train_exactly_k_later():
    d = Dispatcher(groups_per_step=2, max_staleness=2, fixed_staleness=True)
    _, warm_up = d.grant((0, 0), loaded_version=0, wanted=100)
    assert [t.slot for t in warm_up] == list(range(6))  # steps 0..2: the starting weights
    for _ in range(3):
        for slot in d.step_slots():
            assert d.arrived((0, 0), slot)
        d.take()
    # Step 3 is next. Version 2 (newer than the learner's publication, v - k = 1) must not sample it.
    assert d.grant((1, 0), loaded_version=2, wanted=100) == (0, [])
    assert d.grant((0, 0), loaded_version=0, wanted=100)[1] == []  # too old: step 3 would be 3 stale
    assert [t.slot for t in d.grant((0, 0), loaded_version=1, wanted=100)[1]] == [6, 7]  # step 3 only
    assert [t.slot for t in d.grant((1, 0), loaded_version=2, wanted=100)[1]] == [8, 9]  # step 4 only
    assert not d.can_grant(2) and not d.can_grant(1) and d.can_grant(3)


def test_under_fixed_staleness_a_given_back_slot_goes_only_to_the_version_k_before_its_step():
    d = Dispatcher(groups_per_step=2, max_staleness=1, fixed_staleness=True)
    d.grant((0, 0), 0, 4)  # steps 0 and 1, by the starting weights
    for slot in (0, 1):
        d.arrived((0, 0), slot)
    d.take()
    d.release(3, retry_prompt=True)  # step 1's, given back
    # The lowest slot free is step 1's, but version 1 trains step 2 only.
    assert [t.slot for t in d.grant((1, 0), loaded_version=1, wanted=4)[1]] == [4, 5]
    assert [t.slot for t in d.grant((1, 0), loaded_version=0, wanted=4)[1]] == [3]


def test_under_fixed_staleness_a_resumed_run_samples_its_first_steps_by_the_checkpoints_weights():
    state = {"step": 5, "next_position": 10, "retry_positions": [8, 9]}
    d = Dispatcher(groups_per_step=2, max_staleness=2, fixed_staleness=True).restored(state)
    assert d.fixed_staleness and d.first_step == 5
    assert d.grant((0, 1), loaded_version=4, wanted=100) == (0, [])  # older than the resumed weights
    _, tickets = d.grant((0, 1), loaded_version=5, wanted=100)
    assert [t.slot for t in tickets] == list(range(10, 16))  # steps 5..7, by the checkpoint's version 5
    assert [t.position for t in tickets][:3] == [8, 9, 10]  # untrained prompts first
    assert [t.slot for t in d.grant((1, 1), loaded_version=6, wanted=100)[1]] == [16, 17]  # step 8 only


def test_fixed_staleness_needs_the_throttle():
    with pytest.raises(ValueError, match="fixed_staleness=True with throttle=False"):
        Dispatcher(2, 1, throttle=False, fixed_staleness=True)


def test_a_step_trains_a_finished_later_group_in_place_of_one_still_generating_that_can_wait():
    d = Dispatcher(groups_per_step=2, max_staleness=1)
    d.grant((0, 0), loaded_version=0, wanted=4)  # slots 0..3, positions 0..3; position 0 still generating
    for slot in (1, 2, 3):
        assert d.arrived((0, 0), slot)
    assert not d.ready()
    # Slot 0's ticket (weights 0) may be trained at step 1 too: it trades with slot 2, filled.
    assert d.fill_early() == [(2, 0)] and d.ready()
    assert [(slot, position) for slot, _, position in d.take()] == [(0, 2), (1, 1)]
    assert d.slot_of((0, 0), 0) == 2  # the running ticket now fills step 1
    assert d.arrived((0, 0), 2) and d.fill_early() == [] and d.ready()
    assert [(slot, position) for slot, _, position in d.take()] == [(2, 0), (3, 3)]
    assert d.counts["early"] == 1


def test_a_step_waits_for_a_ticket_whose_bound_ends_at_it_whatever_finished_later():
    d = Dispatcher(groups_per_step=1, max_staleness=1)
    d.grant((0, 0), loaded_version=0, wanted=2)  # slots 0, 1: steps 0 and 1, both within version 0's bound
    assert d.arrived((0, 0), 1)
    assert d.fill_early() == [(1, 0)]  # step 0 trains position 1; position 0's ticket moves to step 1
    d.take()
    _, tickets = d.grant((1, 0), loaded_version=1, wanted=1)
    assert [t.slot for t in tickets] == [2] and d.arrived((1, 0), 2)
    # Position 0 (weights 0) can be trained at step 1 at the latest: step 1 waits for it.
    assert d.fill_early() == [] and not d.ready() and d.missing() == [1]


def test_a_given_back_slot_of_the_step_is_filled_by_a_finished_later_group_and_granted_again_later():
    d = Dispatcher(groups_per_step=1, max_staleness=2)
    d.grant((0, 0), 0, 3)
    assert d.arrived((0, 0), 2)
    assert d.given_back((0, 0), [0]) == 1  # position 0's rewards failed: slot 0 is free
    assert d.fill_early() == [(2, 0)]  # position 2's group trains at step 0; slot 2 is free instead
    assert [(slot, position) for slot, _, position in d.take()] == [(0, 2)]
    _, tickets = d.grant((1, 0), 1, 5)
    assert [(t.slot, t.position) for t in tickets] == [(2, 3), (3, 4)]


def test_nothing_moves_under_fixed_staleness_or_without_the_throttle():
    for d in (Dispatcher(groups_per_step=1, max_staleness=1, fixed_staleness=True),
              Dispatcher(groups_per_step=1, max_staleness=1, throttle=False)):
        d.grant((0, 0), 0, 2)
        assert d.arrived((0, 0), 1)
        assert d.fill_early() == [] and not d.ready()
