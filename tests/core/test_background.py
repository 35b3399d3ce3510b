"""Background (batch-job) work's share of a step under the priority policy (core/sched/background.py): nothing while
an interactive request waits, what a step's time allows beside running ones, short steps in a gap of interactive
traffic, full speed once it has been quiet for the idle window; and the batch always finishes. Step times are
fed from a known law (the scheduler's model learns it) and the clock is the test's: nothing is timed."""
from __future__ import annotations

import numpy as np
from scheduler_factories import TOKEN, make_request, make_scheduler

from pagellm.core.sched.background import (
    GAP_EXTRA,
    IDLE_PROMPT_TOKENS,
    IDLE_WINDOW_S,
    MAX_PROMPT_TOKENS,
    MAX_ROWS,
    PROBE_EVERY,
    RIDE_SHARE,
)
from pagellm.core.sched.output import SchedulerOutput
from pagellm.core.sched.scheduler import Scheduler
from pagellm.core.sched.step_time import COLD_STEPS, StepShape

BACKGROUND = 1 << 30
# Seconds = A + B * rows + C * context + D * extra tokens. On a CPU a row costs a good part of a step; on a GPU
# little beside the fixed cost.
CPU = (0.004, 0.0006, 2e-6, 0.0004)
GPU = (0.008, 1e-5, 1e-8, 2e-5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seconds(law: tuple[float, ...], shape: StepShape) -> float:
    return float(np.dot(law, shape.features()))


def scheduler(law: tuple[float, ...], learned: bool = True,
              max_num_batched_tokens: int = 256) -> tuple[Scheduler, Clock]:
    """A priority scheduler on a test clock; `learned`: its step-time model already knows `law`."""
    sched = make_scheduler(scheduling_policy="priority", max_model_len=512, num_blocks=1024, max_num_seqs=16,
                           max_num_batched_tokens=max_num_batched_tokens)
    clock = Clock()
    limiter = sched.planner.limiter
    assert limiter.background is not None and limiter.model is not None
    limiter.background.clock = clock
    if learned:
        rng = np.random.default_rng(0)
        for i in range(COLD_STEPS + 64):
            rows = int(rng.integers(1, 16))
            shape = StepShape(rows, rows * int(rng.integers(8, 300)), int(rng.integers(1, 256)) if i % 3 else 0)
            limiter.model.observe(shape, seconds(law, shape))
    return sched, clock


def run_step(sched: Scheduler, clock: Clock, law: tuple[float, ...]) -> SchedulerOutput:
    """One step taking the law's time on the test clock; returns its output."""
    out = sched.schedule()
    shape = StepShape.of(out)
    sched.observe_step_time(out, seconds(law, shape))
    clock.now += seconds(law, shape)
    sched.update_from_output(out, {s.request_id: [TOKEN] * s.num_samples for s in out.scheduled if s.needs_sample})
    sched.check_consistency()
    return out


def add_background(sched: Scheduler, count: int, prompt: int = 8, max_tokens: int = 8) -> None:
    for i in range(count):
        sched.add_request(make_request(f"bg{i}", prompt=prompt, max_tokens=max_tokens, priority=BACKGROUND,
                                       arrival_time=float(i)))


def split(sched: Scheduler, out: SchedulerOutput) -> tuple[list, list]:
    """The step's (interactive, background) rows."""
    background = [s for s in out.scheduled if s.request_id.startswith("bg")]
    return [s for s in out.scheduled if not s.request_id.startswith("bg")], background


def shape_of(rows: list) -> StepShape:
    return StepShape(len(rows), sum(s.num_computed_tokens + s.num_tokens for s in rows),
                     sum(s.num_tokens - 1 for s in rows))


def gap_bound(law: tuple[float, ...], out: SchedulerOutput) -> float:
    """What a background step in a gap may take: 1 + GAP_EXTRA times a one-row step (at its largest context)."""
    context = max(s.num_computed_tokens + 1 for s in out.scheduled)
    return (1 + GAP_EXTRA) * seconds(law, StepShape(1, context, 0)) + 1e-12


class GapSteps:
    """Checks background steps in a gap: within `gap_bound`, but for the probes (one step in PROBE_EVERY may take
    a row more, at most one row's cost over)."""

    def __init__(self, law: tuple[float, ...]) -> None:
        self.law, self.count, self.over = law, 0, 0

    def check(self, out: SchedulerOutput) -> None:
        self.count += 1
        time, bound = seconds(self.law, StepShape.of(out)), gap_bound(self.law, out)
        if time > bound:
            self.over += 1
            context = max(s.num_computed_tokens + 1 for s in out.scheduled)
            assert time <= bound + seconds(self.law, StepShape(1, context, 0)) - self.law[0]
        assert self.over <= self.count // PROBE_EVERY + 1, (self.over, self.count)


def all_blocks_free(sched: Scheduler) -> bool:
    return sched.kv_cache_manager.block_pool.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_a_waiting_interactive_request_gets_the_step_alone_and_running_ones_keep_it_on_a_cpu():
    sched, clock = scheduler(CPU)
    add_background(sched, 12, prompt=4, max_tokens=60)
    for _ in range(3):
        run_step(sched, clock, CPU)
    sched.add_request(make_request("chat0", prompt=40, max_tokens=20))
    out = run_step(sched, clock, CPU)
    # The running background rows sit the step out, keeping their blocks.
    assert [s.request_id for s in out.scheduled] == ["chat0"] and out.preempted_req_ids == []
    # While it decodes, a background row would add 0.6 ms to a 4.6 ms step, over RIDE_SHARE: none rides along.
    for _ in range(19):
        assert [s.request_id for s in run_step(sched, clock, CPU).scheduled] == ["chat0"]
    assert "chat0" not in sched.requests
    while sched.has_unfinished_requests():
        assert run_step(sched, clock, CPU).scheduled
    assert all_blocks_free(sched)


def test_on_a_gpu_background_rows_ride_along_within_their_share():
    sched, clock = scheduler(GPU)
    add_background(sched, 8, prompt=4, max_tokens=60)
    run_step(sched, clock, GPU)
    for i in range(6):
        sched.add_request(make_request(f"chat{i}", prompt=16, max_tokens=30))
    assert all(s.request_id.startswith("chat") for s in run_step(sched, clock, GPU).scheduled)
    riding = []
    for _ in range(29):
        out = run_step(sched, clock, GPU)
        interactive, background = split(sched, out)
        assert len(interactive) == 6
        # What the background rows add stays within RIDE_SHARE of the interactive rows' step, and they are at most
        # half as many.
        assert seconds(GPU, StepShape.of(out)) <= (1 + RIDE_SHARE) * seconds(GPU, shape_of(interactive)) + 1e-12
        riding.append(len(background))
    assert min(riding) >= 1 and max(riding) == 3


def test_in_a_gap_steps_stay_short_then_full_speed_once_idle_then_short_again():
    sched, clock = scheduler(CPU)
    sched.add_request(make_request("chat0", prompt=8, max_tokens=2))
    while sched.has_unfinished_requests():
        run_step(sched, clock, CPU)
    add_background(sched, 120, prompt=40, max_tokens=20)
    # Interactive traffic was seen just now: every background step stays within the gap's bound and the fixed
    # caps, and the batch moves.
    start, computed, gap = clock.now, [], GapSteps(CPU)
    for i in range(300):
        if i == 299:
            clock.now = start + IDLE_WINDOW_S - 0.01  # the last step of the window
        out = run_step(sched, clock, CPU)
        assert out.scheduled
        gap.check(out)
        assert len(out.scheduled) <= MAX_ROWS and sum(s.num_tokens - 1 for s in out.scheduled) <= MAX_PROMPT_TOKENS
        computed.append(sum(s.num_tokens for s in out.scheduled))
    assert sum(computed) > 300
    # Quiet for the idle window: full speed (the static limits: 256 tokens, 16 rows).
    clock.now = start + IDLE_WINDOW_S
    for _ in range(3):
        out = run_step(sched, clock, CPU)
        assert len(out.scheduled) == 16 or sum(s.num_tokens for s in out.scheduled) == 256
    # An interactive request: its prefill alone, then short background steps again in the gap after it.
    sched.add_request(make_request("chat1", prompt=8, max_tokens=1))
    assert [s.request_id for s in run_step(sched, clock, CPU).scheduled] == ["chat1"]
    for _ in range(20):
        gap.check(run_step(sched, clock, CPU))


def test_once_idle_background_prompt_chunks_stay_short_for_the_next_interactive_request():
    """After the idle window the batch runs at max_num_seqs rows, but its prompt chunks never exceed
    IDLE_PROMPT_TOKENS a step, however large the token budget: that step is what the next arrival waits for."""
    sched, clock = scheduler(CPU, max_num_batched_tokens=2048)
    add_background(sched, 40, prompt=300, max_tokens=4)
    clock.now += IDLE_WINDOW_S
    prompt_tokens = []
    while sched.has_unfinished_requests():
        out = run_step(sched, clock, CPU)
        prompt_tokens.append(sum(s.num_tokens for s in out.scheduled if s.num_computed_tokens < 300))
        assert len(out.scheduled) <= 16
    assert max(prompt_tokens) == IDLE_PROMPT_TOKENS < 2048
    assert all_blocks_free(sched)


def test_background_work_finishes_in_gaps_of_interactive_traffic():
    sched, clock = scheduler(CPU)
    add_background(sched, 12, prompt=20, max_tokens=8)
    finished, steps, gap = set(), 0, GapSteps(CPU)
    while sched.has_unfinished_requests():
        if steps % 25 == 0 and steps < 400:  # an interactive request now and then keeps the window open
            sched.add_request(make_request(f"chat{steps}", prompt=8, max_tokens=4))
        out = run_step(sched, clock, CPU)
        interactive, background = split(sched, out)
        assert not interactive or not background  # never both on this CPU law
        if not interactive:
            gap.check(out)
        finished |= {s.request_id for s in background if s.request_id not in sched.requests}
        steps += 1
        assert steps < 2000
    assert finished == {f"bg{i}" for i in range(12)}
    assert all_blocks_free(sched)


def test_before_the_model_has_learnt_fixed_caps_stand_in():
    sched, clock = scheduler(CPU, learned=False)
    add_background(sched, 24, prompt=40, max_tokens=40)
    sched.add_request(make_request("chat0", prompt=8, max_tokens=40))
    assert [s.request_id for s in run_step(sched, clock, CPU).scheduled] == ["chat0"]
    for i in range(1, 4):
        sched.add_request(make_request(f"chat{i}", prompt=8, max_tokens=40))
    run_step(sched, clock, CPU)
    for _ in range(3):  # four interactive rows: at most two background ones, at most 16 prompt tokens
        interactive, background = split(sched, run_step(sched, clock, CPU))
        assert len(interactive) == 4 and 1 <= len(background) <= 2
        assert sum(s.num_tokens for s in background) <= MAX_PROMPT_TOKENS + len(background)


def test_probes_teach_the_model_a_rows_cost_so_that_gaps_take_several():
    """A model that has only seen one-row steps charges a step's fixed cost per row and allows one background row
    in a gap; the probe steps (a row more) teach it that a row costs little beside the fixed cost, and gap steps
    then take several rows, still within the bound."""
    law = (0.004, 0.0003, 1e-6, 0.0004)  # a row: 7% of a one-row step
    sched, clock = scheduler(law, learned=False)
    model = sched.planner.limiter.model
    for context in range(COLD_STEPS + 32):
        model.observe(StepShape(1, 8 + context, 0), seconds(law, StepShape(1, 8 + context, 0)))
        model.observe(StepShape(1, 8 + context, 7), seconds(law, StepShape(1, 8 + context, 7)))
    sched.add_request(make_request("chat0", prompt=8, max_tokens=1))
    run_step(sched, clock, law)
    add_background(sched, 16, prompt=8, max_tokens=200)
    gap, rows = GapSteps(law), []
    for _ in range(10 * PROBE_EVERY):
        out = run_step(sched, clock, law)
        gap.check(out)
        rows.append(len(out.scheduled))
    assert rows[0] == 1 and min(rows[-PROBE_EVERY:]) >= 2, rows
