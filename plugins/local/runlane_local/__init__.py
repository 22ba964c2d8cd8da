"""runlane-local: the in-memory reference storage driver and the local lane."""
