"""GET-only HTTP routes of the lab node, served by the scheduler's own HTTP server.

``/goblin/report.json`` is public (it is the lab's verification report), but only its totals:
volunteer names and per-volunteer counts go to lab admins (and loopback, where the dashboard
guard trusts it; see ``scheduler_plugins.dashboard_guard``).
"""

from __future__ import annotations

import json

from tornado import web

#: the keys of the report everyone may read
PUBLIC_KEYS = ("tasks", "accepted", "rejected", "by_method", "overhead", "reissued", "seconds")


def public_report(report: dict) -> dict:
    public = {k: report[k] for k in PUBLIC_KEYS if k in report}
    public["volunteer_count"] = len(report.get("volunteers", ()))
    return public


class ReportHandler(web.RequestHandler):
    def initialize(self, ledger):
        self.ledger = ledger

    def get(self):
        report = self.ledger.report()
        if not getattr(self.request, "goblin_trusted", None):  # set by the dashboard guard
            report = public_report(report)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(report))


def install_routes(scheduler, ledger) -> None:
    app = web.Application([(r"/goblin/report.json", ReportHandler, {"ledger": ledger})])
    scheduler.http_application.add_application(app)
