"""The vendored seed contracts equal shared/fixtures/seed_contracts.json where shared/ exists."""
import json

import pytest

from tests.conftest import SHARED_CONTRACTS, VENDORED_CONTRACTS


@pytest.mark.skipif(not SHARED_CONTRACTS.exists(), reason="no shared/ beside this checkout")
def test_vendored_contracts_match_shared():
    assert json.loads(VENDORED_CONTRACTS.read_text()) == json.loads(SHARED_CONTRACTS.read_text())
