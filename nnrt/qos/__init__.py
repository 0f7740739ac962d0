"""Quality of service: priorities, deadlines and the per-app priority
scheduler that fronts every driver (see ``docs/design/scheduler.md``)."""
from .clock import ManualClock
from .front import ScheduledDevice, ScheduledPreparedModel, model_bytes
from .gate import ExecutionGate
from .policy import AppIdentity, Policy, identify
from .scheduler import (AppSettings, ClassStatistics, Job, JobRecord, JobState, Scheduler,
                        SchedulerLoad, SchedulerStatistics, Verdict, check_key, check_memory_limit)

__all__ = ["AppIdentity", "AppSettings", "Policy", "identify", "ClassStatistics", "ExecutionGate", "Job", "JobRecord", "JobState", "ManualClock", "ScheduledDevice", "ScheduledPreparedModel",
           "Scheduler", "SchedulerLoad", "SchedulerStatistics", "Verdict", "check_key", "check_memory_limit", "model_bytes"]
