"""Sync fences (eventfd) and fenced executions."""
