import os
import sys

# Rank bodies live in plain modules beside the tests so spawned ranks can import them; the
# unit tests share helpers the same way.
for _dir in ("multirank", "unit", "gpu"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), _dir))


def pytest_collection_modifyitems(config, items):
    """Everything under tests/multirank starts real gloo ranks: mark it, so the unit layer
    runs alone with `-m "not multirank"` (make test-fast)."""
    import pytest

    for item in items:
        if f"{os.sep}multirank{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.multirank)
