"""Exceptions for bad user input. Each message names the bad value and what is accepted."""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every error deepinfer raises for bad input or a bad environment."""


class ConfigError(DeepInferError, ValueError):
    """A model `config.json` (or an engine option) that deepinfer cannot use."""


class WeightsError(DeepInferError, ValueError):
    """A checkpoint that is missing tensors or shards, or holds tensors of the wrong shape."""


class RequestError(DeepInferError, ValueError):
    """A generation request that cannot be served (too long, bad sampling parameters, ...)."""
