"""Pages: notifiers (Slack, console, JSONL) and the durable dispatcher that feeds them.

The agent builds a dispatcher once and submits incident events to it::

    dispatcher = build_dispatcher(config.notify, run_dir, event_log=event_log)
    dispatcher.submit(event)   # training thread: persist + wake, never blocks on the network
    dispatcher.close(timeout=10)

Names are imported lazily (PEP 562) so that ``agent.eventlog`` can use
``agent.notify.secrets`` without importing slack-sdk or creating an import cycle.
"""

from __future__ import annotations

from agent.lazy_exports import lazy_exports

# Public name -> submodule of agent.notify that defines it.
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "DeliveryError": ".base",
        "DeliveryLookup": ".base",
        "LookupUnavailableError": ".base",
        "MessageRejectedError": ".base",
        "Notifier": ".base",
        "PermanentDeliveryError": ".base",
        "TransientDeliveryError": ".base",
        "DeliveryConfig": ".config",
        "NotifyConfig": ".config",
        "SlackConfig": ".config",
        "resolve_slack": ".config",
        "ConsoleNotifier": ".console",
        "NotifierStatus": ".dispatcher",
        "PageDispatcher": ".dispatcher",
        "build_dispatcher": ".factory",
        "build_notifiers": ".factory",
        "JsonlNotifier": ".jsonl",
        "Outbox": ".outbox",
        "OutboxLockedError": ".outbox",
        "RenderedPage": ".render",
        "render_blocks": ".render",
        "render_page": ".render",
        "render_text": ".render",
        "SlackNotifier": ".slack",
    },
)
