"""Speculative decoding: drafters that propose tokens for a request to verify in one forward pass (the scheduler
asks them, see core/sched/batch.py; acceptance is in core/sched/results.py)."""
