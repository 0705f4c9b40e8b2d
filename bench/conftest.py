"""bench/ is run on its own (`python -m pytest bench -q`); the main test run (testpaths=tests) never collects it.

Caches default to the repository's .cache/ (as .ci/run does), so reruns measure warm Inductor caches
and the built-in tiny model is built once.
"""

import os
from pathlib import Path

_CACHE = Path(__file__).resolve().parent.parent / ".cache"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))
os.environ.setdefault("GRAPHKILN_CACHE", str(_CACHE / "graphkiln"))
