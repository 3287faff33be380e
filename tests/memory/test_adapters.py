"""The adapter slots' bookkeeping: every adapter holds at most one slot, the slots held and free
are all of them, an adapter in use is never evicted, and eviction is least recently placed."""

from hypothesis import given
from hypothesis import strategies as st

from pagedkv.memory.adapters import AdapterResidency


def test_idle_adapters_are_evicted_least_recently_placed_first():
    slots = AdapterResidency(2)
    assert slots.place(1, "a", "/a", in_use=set()) == 0
    assert slots.place(2, "b", "/b", in_use=set()) == 1
    assert slots.place(1, "a", "/a", in_use=set()) == 0  # resident: no load, now most recent
    assert slots.place(3, "c", "/c", in_use=set()) == 1  # 2 was placed least recently
    assert slots.slots() == {1: 0, 3: 1}
    assert [(load.slot, load.lora_int_id) for load in slots.take_loads()] == [(0, 1), (1, 2), (1, 3)]
    assert slots.take_loads() == []
    assert slots.evictions == 1


def test_an_adapter_in_use_keeps_its_slot():
    slots = AdapterResidency(1)
    slots.place(1, "a", "/a", in_use=set())
    assert not slots.can_place(2, in_use={1})
    assert slots.place(2, "b", "/b", in_use={1}) is None
    assert not slots.forget(1, in_use={1})
    assert slots.forget(1, in_use=set())
    assert slots.place(2, "b", "/b", in_use=set()) == 0


@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.sampled_from(["place", "forget"]), st.integers(1, 7), st.sets(st.integers(1, 7))),
        max_size=60,
    ),
)
def test_slots_are_held_once_and_in_use_adapters_stay(num_slots, actions):
    slots = AdapterResidency(num_slots)
    for action, adapter, in_use in actions:
        in_use &= set(slots.slots())  # only resident adapters can be in use
        before = slots.slots()
        if action == "place":
            slot = slots.place(adapter, str(adapter), "/x", in_use)
            assert (slot is None) == (not slots.can_place(adapter, in_use) and adapter not in before)
        else:
            slots.forget(adapter, in_use)
        after = slots.slots()
        assert all(after.get(a) == before[a] for a in in_use)  # in use: never moved or evicted
        assert len(set(after.values())) == len(after) <= num_slots
        assert sorted(list(after.values()) + slots._free) == list(range(num_slots))


def test_a_failed_load_is_undone():
    slots = AdapterResidency(2)
    slots.place(1, "a", "/a", in_use=set())
    slots.place(2, "b", "/b", in_use=set())
    slots.undo([load for load in slots.take_loads() if load.lora_int_id == 2])
    assert slots.slots() == {1: 0}
    assert slots.place(3, "c", "/c", in_use={1}) == 1  # the undone slot is free again
