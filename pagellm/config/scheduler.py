"""The scheduler: `SchedulerConfig` (batch limits, chunked prefill, the policy and preemption mode, async
scheduling, speculative decoding, the latency target) and the policies and preemption modes it accepts."""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.speculative import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority", "short-first")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # short-first: a request that has waited this long goes ahead of every shorter one (the starvation bound).
    short_first_max_wait: float = 10.0
    # Schedule batch N+1 while batch N runs (see core/sched/async_scheduling.py).
    async_scheduling: bool = False
    # Speculative decoding: the scheduler drafts and verifies tokens (see spec_decode/); None: off.
    speculative_config: SpeculativeConfig | None = None
    # A time per output token to hold: waiting requests start in waves (up to max_num_seqs) planned against it with
    # an online model of the step's time (core/sched/tpot_plan.py); None: the static caps only.
    target_tpot_ms: float | None = None
    # Priority policy: requests of this priority or lower are background work (the lines of /v1/batches jobs run
    # at it): they yield each step to others and take a bounded share of it (core/sched/step_limits.py).
    background_priority: int = 1 << 30

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}; fix --scheduling-policy.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got "
                             f"{self.preemption_mode!r}; fix --preemption-mode.")
        if self.short_first_max_wait < 0:
            raise ValueError(f"short_first_max_wait must not be negative, got {self.short_first_max_wait}; fix "
                             f"--short-first-max-wait.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.target_tpot_ms is not None and not self.target_tpot_ms > 0:
            raise ValueError(f"target_tpot_ms must be positive, got {self.target_tpot_ms}; fix --target-tpot-ms.")

    def check_fits(self, max_model_len: int) -> None:
        """Without chunked prefill a prompt runs in one step, so the token budget must hold the longest one."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"With chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({max_model_len}), or a long prompt could never be scheduled. Raise "
                f"max_num_batched_tokens (--max-num-batched-tokens), lower max_model_len (--max-model-len), or "
                f"enable chunked prefill.")
