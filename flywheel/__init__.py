"""Flywheel: contracts shared by every service (wire messages, config, Redis layout)."""

__version__ = "0.1.0"
