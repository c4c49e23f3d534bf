"""``mechwatch report RUN_DIR``: a self-contained HTML report (and a PNG) of one run, from its
event log: the monitored series per layer and router with their alerts' baselines, alerts and
incidents with their onsets, actions, rollbacks (the abandoned path faded) and pages.

One concern per module: ``timeline`` reads the event log, ``figures`` draws, ``markers`` puts
step markers on the panels without overlapping labels, ``html`` writes the page, ``build`` ties
them together and is the command.
"""

from __future__ import annotations

from agent.report.build import ReportFiles, build_report

__all__ = ["ReportFiles", "build_report"]
