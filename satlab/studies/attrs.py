"""What the driver and its trial processes tell each other through the study's storage: trial user attributes (what
optuna-dashboard shows next to each trial), study user attributes, exit codes and environment variables."""

from __future__ import annotations

from satlab.config.errors import EXIT_REQUEUE

REASON = "reason"  # why a trial was pruned or failed: pruned, gate_saturation, nan, oom, timeout, worker_lost, ...
ARCH = "arch"  # the trial's model.arch
VALUE = "objective_value"  # the objective a trial process computed (the driver returns it to Optuna)
SATURATION = "saturated_frac"  # the last val/gates/saturated_frac measured (absent for models without gates)
TOKENS = "tokens_seen"  # tokens seen at the last validation
WOULD_PRUNE_AT = "guard_would_prune_at"  # observe-mode saturation guard: tokens seen when it would have pruned
WOULD_PRUNE_REASON = "guard_would_prune_reason"  # and why (``gate_saturation: ...``); the trial trained on
RUN_ID = "mlflow_run_id"
PID = "pid"
LOG = "log_file"
RETRY_OF = "retry_of"
WORKER = "worker"  # host:pid of the driver running the trial, so a driver on the same host can see it died
IGNORED = "ignored"  # why a grid trial does not count for its cell: another worker had it, or none was left
CPU_SECONDS = "cpu_seconds"  # CPU time (user + system, the process and its children) of the attempt that ended it
CELL = "cell"  # a grid trial's cell key, given when the cell is queued (its parameters are set once it runs)
ATTEMPT_ATTRS = (REASON, VALUE, SATURATION, TOKENS, WOULD_PRUNE_AT, WOULD_PRUNE_REASON, RUN_ID, PID, LOG, WORKER,
                 IGNORED, CPU_SECONDS)
"""Attributes of one attempt: a retried trial inherits the stale one's user attrs and must not keep these."""

PARENT_RUN = "mlflow_parent_run_id"  # study user attributes
TRACKING_URI = "mlflow_tracking_uri"
SPEC = "spec"  # the resolved spec, as a plain dict, for the trial processes
KIND = "kind"
FINGERPRINT = "fingerprint"  # StudySpec.fingerprint of the spec that made the study
SEQUENTIAL_PLAN = "sequential_plan"  # the sequential plan fixed with the study (satlab.studies.sequential_looks)
SEQUENTIAL_LOOKS = "sequential_looks"  # its looks' rows, appended
SUPERSEDED = "superseded_trials"  # grid trials that no longer count for their cell: it was queued again

EXIT_COMPLETE, EXIT_PRUNED, EXIT_FAILED, EXIT_WORKER_LOST = 0, 3, 4, 5
"""Exit codes of a trial process; anything else, or a signal, is a crash the driver describes from the log."""
EXIT_INTERRUPTED = EXIT_REQUEUE  # stopped by SIGTERM with its state checkpointed: the cell resumes, not fails
STORAGE_ENV = "SATLAB_STUDY_STORAGE"  # the storage URL (not argv: it may hold a password)
DRIVER_ENV = "SATLAB_STUDY_DRIVER"  # the driver's pid: the trial ends when it is gone
