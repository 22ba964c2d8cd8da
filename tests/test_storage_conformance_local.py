"""The in-memory reference driver runs the whole storage conformance suite, every optional part on."""

from __future__ import annotations

import pytest
from runlane_local import LocalStorageStore, local_storage_driver

from runlane.testing import StorageDriverConformance


class TestLocalStorageDriver(StorageDriverConformance):
    supports_append = True
    supports_exclusive_candidates = True
    supports_operator_reads = True

    @pytest.fixture
    def store(self) -> LocalStorageStore:
        return LocalStorageStore()

    @pytest.fixture
    def driver(self, store: LocalStorageStore):
        return local_storage_driver(store=store)

    @pytest.fixture
    def peer_driver(self, store: LocalStorageStore):
        return local_storage_driver(store=store)
