"""The lane scenarios over the in-memory reference lane (several drivers over one store = processes)."""

from __future__ import annotations

import pytest

from lane_scenarios import LaneFactory, LaneScenarios
from runlane import create_lane
from runlane.core.lanes import LaneDelivery
from runlane.vocabulary import LaneDeliveryMode
from runlane_local import LocalStorageStore, local_storage_driver


class TestLocalLaneScenarios(LaneScenarios):
    @pytest.fixture
    def lanes(self) -> LaneFactory:
        stores: list[LocalStorageStore] = []

        def lane(store: LocalStorageStore):
            return create_lane(
                storage=local_storage_driver(store=store),
                delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
                name="local",
                operator_reads=True,
            )

        def new():
            stores.append(LocalStorageStore())
            return lane(stores[-1])

        return LaneFactory(new=new, peer=lambda: lane(stores[-1]))
