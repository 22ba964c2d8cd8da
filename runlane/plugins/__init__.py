"""Runlane's plugin system (pluggy project ``runlane``, entry-point group ``runlane``).

Lanes, storage drivers, transports, exporters, observers and CLI commands are provided by plugins;
first-party distributions register exactly like third-party ones.

Importing this package only defines the ``hookimpl`` marker; the plugin manager
(``runlane.plugins.manager``) and the registries (``runlane.plugins.registries``) load on demand.
"""

from .hookspecs import hookimpl

__all__ = ["hookimpl"]
