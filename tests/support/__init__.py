"""Helpers the tests share: real servers started for the test session (PostgreSQL), free ports."""
