"""The relay's tests import relay_fake_engine from this folder (``serve`` is in tests/conftest.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # relay_fake_engine
