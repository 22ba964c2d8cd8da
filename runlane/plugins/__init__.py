"""Runlane's plugin system (pluggy project ``runlane``, entry-point group ``runlane``).

Lanes, storage drivers, transports, exporters, observers and CLI commands are provided by plugins;
first-party distributions register exactly like third-party ones.
"""
