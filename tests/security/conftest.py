"""The security suite's fixtures: the dashboard tests' mesh with two organizations and the HTTP endpoint."""

from __future__ import annotations

from tests.gateway import test_dashboard

board = test_dashboard.board
