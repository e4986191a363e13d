"""Peer drivers, run as subprocesses in `.venv-bench` (see compare.py)."""
