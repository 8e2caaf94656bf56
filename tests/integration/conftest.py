"""Fixtures of the integration tests: a private KREX node (`kx`) and real users (`users`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.krex_world import Krex
from helpers.users import Users, created_users


@pytest.fixture
def kx() -> Iterator[Krex]:
    """A private KREX node (tests/helpers/krex_world.py); always cleaned up, on failure too."""
    k = Krex()
    try:
        yield k
    finally:
        k.cleanup()


@pytest.fixture(scope="module")
def users() -> Iterator[Users]:
    """Four real users and a group (tests/helpers/users.py), shared by one module's tests."""
    with created_users() as u:
        yield u
