import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"real weights and data live in {SHARED_DATA}, which is absent on this machine")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def osscar_home(tmp_path_factory, monkeypatch):
    """Caches (dense loss curves) go to a temporary $OSSCAR_HOME, never the user's."""
    home = tmp_path_factory.mktemp("osscar-home")
    monkeypatch.setenv("OSSCAR_HOME", str(home))
    return home
