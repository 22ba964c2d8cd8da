"""The closed catalog of storage index names.

Drivers map each name to a native plan; there is no generic scan or predicate API. Every entry of a
record names its index, a partition tuple (equality match) and a sort tuple (range + order). The
shapes core writes are listed beside each name; drivers treat the components as opaque strings.
"""

from __future__ import annotations

import enum

__all__ = ["StorageIndexName"]


class StorageIndexName(enum.StrEnum):
    # Worker acquisition: runnable candidates of one queue.
    #   partition (environment, queue)             sort (runnable_available_at, run_id)
    RUNS_RUNNABLE = "runs_runnable"
    # Bounded-queue dispatch: queued runs without an active dispatch reservation.
    #   partition (environment, queue)             sort (dispatch_available_at, run_id)
    RUNS_NEEDING_DISPATCH = "runs_needing_dispatch"
    # Delivery recovery: due scheduled/released/retrying runs and expired-lease running runs.
    #   partition (environment,)                   sort (recovery_available_at, run_id)
    # and the completion-wait markers of finished runs whose waiters may not all be resumed yet (the
    # record key, the source run id, orders ties).
    #   partition (environment, "run_completion_waits")   sort (resume_due,)
    RUNS_NEEDING_DELIVERY = "runs_needing_delivery"
    # Cancellation finalization: cancellation_requested runs by current lease expiry.
    #   partition (environment,)                   sort (lease_expires_at, run_id)
    RUNS_NEEDING_CANCELLATION_FINALIZATION = "runs_needing_cancellation_finalization"
    # Timeout finalization: started running attempts by fixed attempt deadline.
    #   partition (environment,)                   sort (attempt_deadline_at, run_id)
    RUNS_NEEDING_TIMEOUT_FINALIZATION = "runs_needing_timeout_finalization"
    # Signal waits: released runs waiting on one signal key (a key past 256 bytes by its digest); the
    # record key, the run id, orders ties.
    #   partition (environment, signal_key)        sort (created_at,)
    RUNS_WAITING_FOR_SIGNAL = "runs_waiting_for_signal"
    # Run-completion waits: released runs waiting on one source run id (the authoritative waiter set); the
    # record key, the run id, orders ties.
    #   partition (environment, source_run_id)     sort (created_at,)
    RUNS_WAITING_FOR_COMPLETION = "runs_waiting_for_completion"
    # Terminal runs by finish time, for pruning.
    #   partition (environment,)                   sort (finished_at, run_id)
    RUNS_TERMINAL_BY_FINISHED_AT = "runs_terminal_by_finished_at"
    # Linked children of a source run (rerun, manual retry, child triggers); the record key, the run id,
    # orders ties.
    #   partition (environment, source_run_id)     sort (created_at,)
    RUNS_BY_SOURCE_RUN = "runs_by_source_run"
    # One run's history and child rows, for replay, attempts and pruning cleanup.
    #   partition (environment, run_id)            sort (sequence,)       sequence as a sortable u64
    RUN_EVENTS_BY_RUN = "run_events_by_run"
    #   partition (environment, run_id)            sort (step_key,)       a key past 512 bytes by its digest
    RUN_STEPS_BY_RUN = "run_steps_by_run"
    #   partition (environment, run_id)            sort (created_at, message_id)
    OUTBOX_BY_RUN = "outbox_by_run"
    # Outbox publishing: pending, failed and claimed rows by next availability / claim expiry.
    #   partition (environment,)                   sort (available_at, message_id)
    OUTBOX_DUE = "outbox_due"
    # Idempotency owner retention: terminal owners by expiry (the record key, task id and key, orders ties).
    #   partition (environment,)                   sort (expires_at,)
    IDEMPOTENCY_OWNERS_BY_EXPIRY = "idempotency_owners_by_expiry"
    # Schedule occurrences whose claim may expire, for crash recovery.
    #   partition (environment,)                   sort (claim_expires_at, occurrence_id)
    SCHEDULE_OCCURRENCES_CLAIMED = "schedule_occurrences_claimed"
    # Pruning tombstones awaiting child cleanup.
    #   partition (environment,)                   sort (tombstoned_at, run_id)
    RUN_TOMBSTONES = "run_tombstones"
    # The ordered observation stream.
    #   partition (environment,)                   sort (stream_position,)  position as a sortable u64
    OBSERVATION_STREAM = "observation_stream"
