"""Runlane test helpers and conformance suites."""
