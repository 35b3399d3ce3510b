"""The scheduling half of core/: the `Scheduler` facade (scheduler.py) over parts that own their state: the live
requests, their queues and the transitions between them (queues.py), the step's batch choice (batch.py) and the
application of its results (results.py). Beside them: the policies (policy.py), async scheduling
(async_scheduling.py), the workers' view of each sequence (worker_view.py) and what a step hands to the workers
(output.py)."""
