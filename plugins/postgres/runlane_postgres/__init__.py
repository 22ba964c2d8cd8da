"""runlane-postgres: the production storage driver for Runlane.

This distribution will hold ``postgres_storage(...)`` (a ``StorageDriver`` with operator reads,
ordered append and exclusive candidates over psycopg 3), its migration SQL and the
``postgres-polling`` lane. Until then it only reserves the package name and import path.
"""
