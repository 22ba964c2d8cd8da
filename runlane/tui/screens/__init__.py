"""The dashboard's screens, one per module."""
