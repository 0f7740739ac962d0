"""Test tools: the CTS runner."""
