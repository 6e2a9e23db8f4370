"""Tandem's shared runtime: every service boots, authenticates, validates, logs, traces, stores and
calls other services through this package. It never imports torch (see ARCHITECTURE.md)."""
