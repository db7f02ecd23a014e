"""GET-only HTTP routes of the lab node, served by the scheduler's own HTTP server."""

from __future__ import annotations

import json

from tornado import web


class ReportHandler(web.RequestHandler):
    def initialize(self, ledger):
        self.ledger = ledger

    def get(self):
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.ledger.report()))


def install_routes(scheduler, ledger) -> None:
    app = web.Application([(r"/goblin/report.json", ReportHandler, {"ledger": ledger})])
    scheduler.http_application.add_application(app)
