"""``runlane tui``: a Textual dashboard over the public operator API.

The runs table (live, filtered by status, queue or text), a queue overview, and a run's detail with
its event timeline and attempts, with cancel / retry / rerun behind a confirmation. Data comes from
``DashboardClient``: the same operations the ``runlane`` commands run, on a runtime in this process
or inside a live ``runlane dev`` session. Nothing outside this package imports Textual.
"""

from __future__ import annotations

from .app import RunlaneDashboard
from .client import DashboardClient

__all__ = ["DashboardClient", "RunlaneDashboard"]
