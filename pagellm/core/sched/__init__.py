"""The scheduling half of core/: the `Scheduler` (scheduler.py), the step's batch choice (batch.py) and results
(results.py), the policies (policy.py), async scheduling (async_scheduling.py), the workers' view of each sequence
(worker_view.py) and what a step hands to the workers (output.py)."""
