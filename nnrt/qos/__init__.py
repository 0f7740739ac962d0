"""Quality of service: priorities and deadlines (the scheduler joins them here)."""
from .priority import Priority, check_deadline, check_priority

__all__ = ["Priority", "check_deadline", "check_priority"]
