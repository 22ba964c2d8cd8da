"""``runlane tui``: the Textual dashboard over the public runtime API (runs, events, queues, actions).

Nothing outside this package imports ``textual``.
"""
