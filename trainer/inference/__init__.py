"""Inference workers: generation engines, the worker process, traces and weight sync (see trainer/README.md)."""
