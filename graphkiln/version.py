"""The installed distribution's version: pyproject.toml is the one place it is written."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("graphkiln")
except PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
