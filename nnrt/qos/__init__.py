"""Quality of service: priorities, deadlines and the per-app priority
scheduler that fronts every driver (see ``docs/qos.md``)."""
from .clock import ManualClock
from .gate import ExecutionGate
from .scheduler import (ClassStatistics, Job, JobRecord, JobState, Scheduler,
                        SchedulerStatistics, Verdict, check_key, check_memory_limit)

__all__ = ["ClassStatistics", "ExecutionGate", "Job", "JobRecord", "JobState", "ManualClock",
           "Scheduler", "SchedulerStatistics", "Verdict", "check_key", "check_memory_limit"]
