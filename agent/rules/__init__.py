"""Declarative YAML alert rules: schema, located loader, and the Prometheus-style engine."""

from __future__ import annotations

from agent.rules.detector_catalog import DetectorCatalog, default_detector_catalog
from agent.rules.engine import Alert, AlertTransition, RuleEngine, RuleHealth, RuleProblem
from agent.rules.errors import RuleFileError, RuleFileErrors
from agent.rules.loader import default_rule_files, load_rule_files, load_rule_text
from agent.rules.ruleset import Rule, RuleSet
from agent.rules.schema import ActionSpec, Duration, RuleSpec

__all__ = [
    "ActionSpec",
    "Alert",
    "AlertTransition",
    "DetectorCatalog",
    "Duration",
    "Rule",
    "RuleEngine",
    "RuleFileError",
    "RuleFileErrors",
    "RuleHealth",
    "RuleProblem",
    "RuleSet",
    "RuleSpec",
    "default_detector_catalog",
    "default_rule_files",
    "load_rule_files",
    "load_rule_text",
]
