"""One guard in front of everything the lab node's HTTP server (the dashboard port) serves.

The rule: distributed's own pages (``/status`` and every bokeh page, ``/info/*`` with the logs,
``/json/*``, ``/sitemap.json``, ``/metrics``, ``/statics``, ``/proxy``, ``/eventstream``, ``/api/*``,
and anything added later) are served only to

* a request carrying the session cookie of a signed-in lab admin (``goblin.admins``, signed in
  at ``/goblin/signin``), or
* a request from a loopback address when the HTTP server listens on loopback addresses only
  (``LabNode.local``, ``goblin demo``, ``goblin node`` without ``--host``): the single-machine
  case.  Set ``goblin.dashboard.trust-loopback: false`` where loopback is not one person (a
  shared login node, or a reverse proxy on the same machine).

Public, to anyone: ``/health``, the researcher pages under ``/goblin/`` (they check sessions
themselves), ``/goblin/report.json`` and the lab's page ``/goblin/`` with ``/goblin/api/status``
(whose public forms have totals only, see ``scheduler_plugins.http``).  Everything else gets a short 403 written without rendering
anything, decided in ``find_handler`` before any handler runs; unauthenticated requests beyond a
per-IP token bucket (``goblin.dashboard.anonymous-rate`` per second, ``anonymous-burst``) get 429.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Callable

from tornado import web

from goblin_dask import settings

#: the request attribute the guard sets: "admin", "loopback", or None
TRUST_ATTRIBUTE = "goblin_trusted"


class _Refused(web.RequestHandler):
    def initialize(self, status: int, retry_after: int | None = None):
        self.status, self.retry_after = status, retry_after

    def prepare(self):
        self.set_status(self.status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        if self.retry_after:
            self.set_header("Retry-After", str(self.retry_after))
            self.finish("too many requests\n")
        else:
            self.finish("this page is for lab admins: sign in at /goblin/signin\n")

    def check_xsrf_cookie(self):  # a refusal of any method, never a form
        pass


class TokenBuckets:
    """Per-key token buckets (``rate`` per second, ``burst`` deep), at most ``max_keys`` remembered."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000):
        self.rate, self.burst, self.clock, self.max_keys = rate, burst, clock, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> float:
        """0 if a token was taken, else the seconds until one is there."""
        now = self.clock()
        tokens, then = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[key] = (tokens - 1, now)
        return 0.0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def listens_on_loopback_only(http_server) -> bool:
    sockets = list(getattr(http_server, "_sockets", {}).values())
    return bool(sockets) and all(_is_loopback(s.getsockname()[0]) for s in sockets)


class DashboardGuard:
    """Decides, per request, whether it is served; see the module's docstring for the rule."""

    def __init__(self, admin_of_request: Callable, *, public_handlers: tuple[type, ...], public_apps: tuple,
                 trust_loopback: bool, rate: float = 20.0, burst: float = 60.0):
        self.admin_of_request = admin_of_request  # request -> admin e-mail or None
        self.public_handlers, self.public_apps = public_handlers, public_apps
        self.trust_loopback = trust_loopback
        self.buckets = TokenBuckets(rate, burst)

    def trust(self, request) -> str | None:
        if self.trust_loopback and _is_loopback(request.remote_ip or ""):
            return "loopback"
        try:
            return "admin" if self.admin_of_request(request) else None
        except Exception:  # a malformed cookie is no session
            return None

    def is_public(self, delegate) -> bool:
        handler = getattr(delegate, "handler_class", None)
        if handler is None or issubclass(handler, web.ErrorHandler):  # no route: a stranger learns nothing
            return False
        return getattr(delegate, "application", None) in self.public_apps or issubclass(handler, self.public_handlers)

    def route(self, application, request, delegate):
        """The delegate to use for ``request``: ``delegate`` itself, or a refusal."""
        trusted = self.trust(request)
        setattr(request, TRUST_ATTRIBUTE, trusted)
        if trusted:
            return delegate
        wait = self.buckets.take(request.remote_ip or "")
        if wait:
            return application.get_handler_delegate(request, _Refused, {"status": 429, "retry_after": int(wait) + 1})
        if self.is_public(delegate):
            return delegate
        return application.get_handler_delegate(request, _Refused, {"status": 403})


def install_dashboard_guard(scheduler, access_app: web.Application | None) -> DashboardGuard | None:
    """Put the guard in front of ``scheduler.http_application`` (after every other route is added)."""
    from distributed.http.health import HealthHandler

    from goblin_dask.access.web import admin_of_request
    from scheduler_plugins.http import LabPageHandler, ReportHandler, StatusHandler

    application = getattr(scheduler, "http_application", None)
    if application is None:
        return None
    trust_loopback = (bool(settings.get("goblin.dashboard.trust-loopback"))
                      and listens_on_loopback_only(scheduler.http_server))
    guard = DashboardGuard(
        (lambda request: admin_of_request(access_app, request)) if access_app is not None else (lambda request: None),
        public_handlers=(HealthHandler, ReportHandler, LabPageHandler, StatusHandler), public_apps=(access_app,) if access_app is not None else (),
        trust_loopback=trust_loopback, rate=float(settings.get("goblin.dashboard.anonymous-rate")),
        burst=float(settings.get("goblin.dashboard.anonymous-burst")))
    find_handler = application.find_handler

    def guarded_find_handler(request, **kwargs):
        return guard.route(application, request, find_handler(request, **kwargs))

    application.find_handler = guarded_find_handler
    application.goblin_guard = guard
    return guard
