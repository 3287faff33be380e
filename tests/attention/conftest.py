"""Every attention test runs with the per-call input checks on: they are what the bad-input
tests exercise, and they make every other test fail loudly on inconsistent inputs."""

import pytest

from pagedkv.attention import set_per_call_checks


@pytest.fixture(autouse=True)
def per_call_checks():
    previous = set_per_call_checks(True)
    yield
    set_per_call_checks(previous)
