"""Which detectors a rule file may name, and how the engine builds them.

The default catalog is the registry in ``agent.detectors``; tests and integrations can pass
their own (a fake detector, a custom algorithm) to ``load_rule_files`` and ``RuleEngine``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.detectors.base import DetectorProtocol


@dataclass(frozen=True)
class DetectorCatalog:
    """Detector classes by YAML ``type`` (each with a pydantic ``Params`` model), and a
    factory ``build(type_name, params)`` of objects that follow ``DetectorProtocol``."""

    types: Mapping[str, type]
    build: Callable[[str, Mapping[str, Any]], DetectorProtocol]

    def params_model(self, type_name: str) -> type:
        """The pydantic model of a type's parameters; ValueError lists the valid types."""
        if type_name not in self.types:
            valid = ", ".join(sorted(self.types))
            raise ValueError(f"unknown detector type '{type_name}'; valid types: {valid}")
        return self.types[type_name].Params

    def check(self, type_name: str, params: Mapping[str, Any]) -> None:
        """Validate parameters strictly: a string is never read as a number or a boolean
        (``off`` is not False, ``"2.0"`` is not 2.0; an int is still a valid float). Declare
        sequence parameters as ``list`` (strict mode does not turn a YAML list into a tuple).
        Raises ValueError for an unknown type, pydantic ValidationError for bad parameters."""
        self.params_model(type_name).model_validate(dict(params), strict=True)


def default_detector_catalog() -> DetectorCatalog:
    """The detectors shipped in ``agent.detectors``."""
    from agent.detectors import DETECTORS, build_detector

    return DetectorCatalog(types=DETECTORS, build=build_detector)
