"""Coordinator: HTTP API, job store, scheduler."""
