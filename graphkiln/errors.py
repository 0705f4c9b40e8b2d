"""Typed errors. Every message names the file, field or value at fault and what to do."""


class GraphkilnError(Exception):
    """Base class of every error graphkiln raises on purpose."""


class ModelFileError(GraphkilnError):
    """A model directory is missing a file, or a file is unreadable or corrupt."""


class WeightMismatchError(ModelFileError):
    """A checkpoint tensor is missing, unexpected, or its shape disagrees with config.json."""


class UnsupportedModelError(GraphkilnError):
    """The checkpoint's architecture or a config feature is not implemented."""


class ConfigError(GraphkilnError, ValueError):
    """A configuration value (dtype, device, bucket list, ...) is invalid."""


class RequestError(GraphkilnError, ValueError):
    """A request cannot be served: empty prompt, prompt longer than the context, bad parameters."""


class CapacityError(GraphkilnError):
    """A request can never fit the KV cache or a batch exceeds what was configured."""


class ArtifactError(GraphkilnError):
    """A compiled artifact directory is missing, stale, tampered with or from another setup."""


class RequestFailedError(GraphkilnError):
    """A request failed inside an engine step (a device or runtime fault, not its parameters); the engine
    freed it and serves on. `outputs` holds what the call produced, the failed requests with finish_reason "error"."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


class RankFailedError(GraphkilnError):
    """A rank of a tensor-parallel group died or failed in a step; the group cannot continue: load again."""
