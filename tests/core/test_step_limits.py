"""Per-step limits: the online step-time model (--target-tpot-ms) and the order in which the plan starts requests
(the plan itself: test_tpot_plan.py; background work's share: test_background.py). Step times are fed from a known
law, not measured."""
from __future__ import annotations

import numpy as np
import pytest
from scheduler_factories import TOKEN, make_request, make_scheduler

from pagellm.core.sched.scheduler import Scheduler
from pagellm.core.sched.step_limits import HEADROOM
from pagellm.core.sched.step_time import StepShape, StepTimeModel

# The synthetic law: seconds = A + B * rows + C * context + D * extra tokens.
A, B, C, D = 0.004, 0.0006, 2e-6, 0.0004


def law(shape: StepShape) -> float:
    return A + B * shape.rows + C * shape.context + D * shape.extra_tokens


def run_step(sched: Scheduler, seconds=law):
    """One step whose time follows `seconds(shape)`; returns its output."""
    out = sched.schedule()
    sampled = {s.request_id: [TOKEN] * s.num_samples for s in out.scheduled if s.needs_sample}
    sched.observe_step_time(out, seconds(StepShape.of(out)))
    sched.update_from_output(out, sampled)
    sched.check_consistency()
    return out


def test_model_fits_a_linear_law():
    rng = np.random.default_rng(0)
    model = StepTimeModel()
    for i in range(200):
        rows = int(rng.integers(1, 64))
        shape = StepShape(rows, rows * int(rng.integers(20, 400)), int(rng.integers(1, 512)) if i % 4 == 0 else 0)
        model.observe(shape, law(shape))
    np.testing.assert_allclose(model.coef, [A, B, C, D], rtol=1e-6, atol=1e-12)
    # The cap it gives, against the law solved by hand: (T - A) / (B + C * context) rows.
    assert model.rows_within(0.0505, [200] * 64) == int((0.0505 - A) / (B + C * 200)) == 46
    assert model.rows_within(0.0505, [200] * 20) == 20
    assert model.max_extra_tokens(0.0505, StepShape(10, 2000, 0)) == int((0.0505 - A - 10 * B - 2000 * C) / D)


def test_steps_of_one_size_predict_that_size_and_larger_ones_no_cheaper():
    """All steps had 8 rows: the fixed cost cannot be told from the per-row cost; such a step is predicted right,
    and a larger one is not predicted cheaper than it is (the cap errs small)."""
    model = StepTimeModel()
    for _ in range(16):
        model.observe(StepShape(8, 800, 0), law(StepShape(8, 800, 0)))
    assert model.predict(StepShape(8, 800, 0)) == pytest.approx(law(StepShape(8, 800, 0)))
    assert model.predict(StepShape(16, 1600, 0)) >= law(StepShape(16, 1600, 0))


def test_a_few_long_prompt_steps_do_not_skew_the_decode_step():
    """One-row decodes of ~13 ms (a fifth 1.65x slower, one in twenty stalled 4-40x) among prompt steps of about a
    second whose cost per token is not linear, all as a shared host gives them. Fitted in seconds, the few long
    steps' misses outweighed the many decodes' and the decode step came out 13-28% high (a live run on a loaded host
    reached 3x: a cap of one row); weighed by relative error it is predicted within 10%."""
    decode_s = 0.0127
    for seed in range(8):
        rng = np.random.default_rng(seed)
        model = StepTimeModel()
        for _ in range(4):
            model.observe(StepShape(1, 128, 127), 0.8 * rng.uniform(0.7, 1.4))
            model.observe(StepShape(8, 1024, 1016), 2.0 * rng.uniform(0.7, 1.4))
            for j in range(60):
                draw = rng.uniform()
                slow = rng.uniform(4, 40) if draw < 0.05 else 1.65 if draw < 0.25 else rng.uniform(0.97, 1.05)
                model.observe(StepShape(1, 129 + j, 0), decode_s * slow)
        assert model.predict(StepShape(1, 150, 0)) == pytest.approx(decode_s, rel=0.1), seed


@pytest.mark.parametrize("policy", ["priority", "short-first", "fcfs"])
def test_the_cap_starts_the_requests_the_policy_ranks_first(policy):
    """A decode batch of two fits the target, one of three does not (as far as the model can tell, having seen two):
    of six requests that arrive at once, once the model has learnt from two others, the two the policy ranks first
    start and run."""
    target_ms = 1.3e3 * law(StepShape(2, 2 * 50, 0)) / HEADROOM
    sched = make_scheduler(max_model_len=256, num_blocks=256, max_num_seqs=8, scheduling_policy=policy,
                           target_tpot_ms=target_ms)
    for i in range(2):
        sched.add_request(make_request(f"warm{i}", prompt=8, max_tokens=16, arrival_time=-1.0))
    while sched.has_unfinished_requests():  # the model learns from their steps
        run_step(sched)
    assert sched.planner.limiter.model.decode_time(3, 3 * 50) > target_ms * HEADROOM / 1e3
    # Priority ranks r5 first (lowest value), short-first r0 (fewest tokens left), fcfs r0..r5 in arrival order.
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt=8, max_tokens=20 + 4 * i,
                                       priority=5 - i if policy == "priority" else 0, arrival_time=float(i)))
    for _ in range(4):
        run_step(sched)
    running = [s.request_id for s in run_step(sched).scheduled]
    expected = {"priority": ["r5", "r4"], "short-first": ["r0", "r1"], "fcfs": ["r0", "r1"]}[policy]
    assert sorted(running) == sorted(expected)


def test_an_unreachable_target_still_runs_one_sequence_a_step():
    sched = make_scheduler(max_model_len=256, num_blocks=256, max_num_seqs=8, target_tpot_ms=0.001)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt=8, max_tokens=6, n=2 if i == 0 else 1))
    steps = 0
    while sched.has_unfinished_requests():
        assert run_step(sched).scheduled
        steps += 1
        assert steps < 200
    assert sched.kv_cache_manager.block_pool.num_free_blocks == sched.kv_cache_manager.num_blocks

