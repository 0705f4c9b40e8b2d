"""Python bytecode for the installed packages, as `pip install` writes it, before any start-up is timed.

Start-up times depend on it: without .pyc files every fresh process compiles torch's sources again
(on the H200 machine, whose image ships none and sets PYTHONDONTWRITEBYTECODE=1, `import graphkiln.api`
took 12.3 s instead of 5.7 s). What is missing is written once, for both sides' children alike, and
recorded in the results.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import sys
import time
from pathlib import Path


def ensure_bytecode() -> dict:
    """Compile the site-packages that hold torch unless torch's own bytecode is there already."""
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    if (torch_dir / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").exists():
        return {"state": "present"}
    start = time.time()
    ok = compileall.compile_dir(torch_dir.parent, quiet=2, workers=os.cpu_count() or 1)
    return {"state": "written" if ok else "partly written (some directories are read-only)",
            "directory": str(torch_dir.parent), "seconds": round(time.time() - start, 1)}
