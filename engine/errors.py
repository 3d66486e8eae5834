"""Typed errors of the engine library. Each names what was wrong."""


class ZenserveError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(ZenserveError, ValueError):
    """A request or its sampling parameters cannot be served (maps to HTTP 400)."""


class ModelLoadError(ZenserveError):
    """The model path does not exist, is not a model, or its files are corrupt."""


class WeightsMismatchError(ModelLoadError):
    """Checkpoint tensors do not match the model: missing, unexpected or mis-shaped."""


class UnsupportedModelError(ModelLoadError):
    """The architecture or a tensor type is not one zenserve implements."""


class ConfigError(ZenserveError, ValueError):
    """Engine options that cannot work together (or on this machine)."""


class EngineDeadError(ZenserveError):
    """The engine loop stopped; no request can make progress."""


class QueueFullError(ZenserveError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 503)."""
