"""Shipped YAML rule packs (installed as the ``mechwatch_rules`` package)."""
