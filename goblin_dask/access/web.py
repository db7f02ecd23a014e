"""The sign-in and access-request pages, a tornado app for the scheduler's HTTP server.

Plain HTML forms (no JavaScript).  Every POST carries tornado's XSRF token; every cookie is
HttpOnly and SameSite=Strict (and Secure when served over HTTPS), the session cookie signed too.
Private keys are never served: an approved researcher's page says the credential is
ready, and the admin hands the file over.  The dashboard port is plain HTTP unless the
admin sets ``distributed.scheduler.dashboard.tls.*``, so the codes travel in clear
otherwise: on a real network, serve the dashboard over TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from tornado import web

from goblin_dask.access.mail import SmtpSettings, send_code
from goblin_dask.access.registry import AccessError, ResearcherRegistry, normalize_email
from goblin_dask.access.signin import CodeRefused, RateLimited, SignIn, SignInLimits, admin_emails

logger = logging.getLogger("goblin_dask.access")

PREFIX = "/goblin"
SESSION_COOKIE = "goblin_session"
FIELD_LIMITS = {"name": 200, "affiliation": 300, "purpose": 5000}
PAGE_TITLES = {"signin.html": "Sign in", "code.html": "Enter your sign-in code", "access.html": "Research access",
               "admin.html": "Access requests"}
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class PageHandler(web.RequestHandler):
    """Shared by every page: the signed-in address, security headers, and error pages."""

    def initialize(self, signin: SignIn, smtp: SmtpSettings | None, admins: frozenset[str]):
        self.signin, self.registry, self.smtp, self.admins = signin, signin.registry, smtp, admins

    def set_default_headers(self):
        for name, value in _SECURITY_HEADERS.items():
            self.set_header(name, value)

    def set_cookie(self, name: str, value: str | bytes, **kwargs) -> None:
        """Every cookie of these pages (session and XSRF) is HttpOnly and SameSite=Strict, Secure over HTTPS."""
        kwargs.update(httponly=True, samesite="Strict", secure=self.request.protocol == "https")
        super().set_cookie(name, value, **kwargs)

    def session_token(self) -> str | None:
        token = self.get_signed_cookie(SESSION_COOKIE, max_age_days=self.signin.limits.session_ttl / 86400)
        return token.decode() if token else None

    def get_current_user(self) -> str | None:
        return self.signin.session_email(self.session_token())

    @property
    def is_admin(self) -> bool:
        return self.current_user in self.admins

    def page(self, template: str, status: int = 200, **values) -> None:
        values.setdefault("title", PAGE_TITLES.get(template, ""))
        values.setdefault("code_minutes", f"{self.signin.limits.code_ttl / 60:g}")
        self.set_status(status)
        self.render(template, prefix=PREFIX, email=self.current_user, is_admin=self.is_admin, **values)

    def message(self, status: int, title: str, text: str, link: tuple[str, str] | None = None) -> None:
        self.page("message.html", status, title=title, text=text, link=link)

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None))[1]
        if status_code == 403 and "_xsrf" in str(getattr(exc, "log_message", "")):
            text = "This form was not sent from this site's own page, or it has expired. Reload the page and try again."
        else:
            text = self._reason
        self.message(status_code, self._reason, text, (f"{PREFIX}/signin", "Back to sign-in"))

    def require_admin(self) -> None:
        if not self.is_admin:
            raise web.HTTPError(403, reason="Only a lab admin may see this page")


class SignInHandler(PageHandler):
    def get(self):
        self.page("signin.html", 200 if self.smtp else 503, error=None, value="")

    async def post(self):
        value = self.get_body_argument("email", "")
        try:
            email = normalize_email(value)
        except ValueError:
            return self.page("signin.html", 400, error="Enter an e-mail address such as name@example.org.", value=value)
        if self.smtp is None:
            return self.page("signin.html", 503, error=None, value=value)
        try:
            code = self.signin.issue_code(email, self.request.remote_ip)
        except RateLimited as e:
            self.set_header("Retry-After", str(e.retry_after))
            minutes = -(-e.retry_after // 60)
            return self.message(429, "Too many sign-in codes requested",
                                f"{e}. You can ask for a new code in {minutes} minute{'s' * (minutes != 1)}.",
                                (f"{PREFIX}/signin", "Back to sign-in"))
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, send_code, self.smtp, email, code, self.signin.limits.code_ttl / 60)
        except OSError as e:  # smtplib's errors are OSErrors
            logger.warning("could not e-mail a sign-in code to %s: %s", email, e)
            return self.message(502, "The e-mail could not be sent",
                                "The lab node could not send the sign-in code. Try again later, or tell the lab admin.",
                                (f"{PREFIX}/signin", "Back to sign-in"))
        self.page("code.html", email_sent=email, error=None, need_new_code=False)


class CodeHandler(PageHandler):
    def post(self):
        email = self.get_body_argument("email", "")
        try:
            token = self.signin.redeem_code(email, self.get_body_argument("code", ""), self.request.remote_ip)
        except (CodeRefused, ValueError) as e:
            need_new = getattr(e, "need_new_code", True)
            return self.page("code.html", 403 if isinstance(e, CodeRefused) else 400, email_sent=email,
                             error=str(e).capitalize() + ".", need_new_code=need_new)
        self.set_signed_cookie(SESSION_COOKIE, token, expires_days=None)
        self.redirect(f"{PREFIX}/access", status=303)


class AccessRequestHandler(PageHandler):
    @web.authenticated
    def get(self):
        self.page("access.html", request=self.registry.get(self.current_user), error=None, values={})

    @web.authenticated
    def post(self):
        values = {k: self.get_body_argument(k, "")[:limit] for k, limit in FIELD_LIMITS.items()}
        try:
            self.registry.submit(self.current_user, **values)
        except AccessError as e:
            return self.page("access.html", 400, request=self.registry.get(self.current_user),
                             error=str(e).capitalize() + ".", values=values)
        self.redirect(f"{PREFIX}/access", status=303)


class AdminHandler(PageHandler):
    @web.authenticated
    def get(self):
        self.require_admin()
        self.page("admin.html", requests=self.registry.list(), error=None)

    @web.authenticated
    def post(self):
        """An admin's decision on one request: ``decision`` is approve or refuse."""
        self.require_admin()
        email, decision = self.get_body_argument("email", ""), self.get_body_argument("decision", "")
        try:
            if decision == "approve":
                path = self.registry.approve(email)
                logger.info("admin %s approved %s: %s", self.current_user, email, path)
            elif decision == "refuse":
                self.registry.refuse(email)
                logger.info("admin %s refused %s", self.current_user, email)
            else:
                raise AccessError(f"unknown decision {decision!r}")
        except (AccessError, ValueError) as e:
            return self.page("admin.html", 400, requests=self.registry.list(), error=str(e).capitalize() + ".")
        self.redirect(f"{PREFIX}/admin", status=303)


class SignOutHandler(PageHandler):
    def post(self):
        self.signin.end_session(self.session_token())
        self.clear_cookie(SESSION_COOKIE)
        self.redirect(f"{PREFIX}/signin", status=303)


def make_app(state_dir: str | os.PathLike, *, smtp: SmtpSettings | None = None, admins: frozenset[str] | None = None,
             limits: SignInLimits | None = None) -> web.Application:
    """The pages for the lab node of ``state_dir``; settings default to dask config and environment."""
    registry = ResearcherRegistry(state_dir)
    signin = SignIn(registry, limits or SignInLimits.from_config())
    context = {"signin": signin, "smtp": smtp or SmtpSettings.from_config(),
               "admins": admin_emails() if admins is None else admins}
    if context["smtp"] is None:
        logger.warning("no SMTP server configured (goblin.smtp or GOBLIN_SMTP_HOST): researchers cannot sign in")
    routes = [
        (rf"{PREFIX}/?", web.RedirectHandler, {"url": f"{PREFIX}/access"}),
        (rf"{PREFIX}/signin", SignInHandler, context),
        (rf"{PREFIX}/signin/code", CodeHandler, context),
        (rf"{PREFIX}/access", AccessRequestHandler, context),
        (rf"{PREFIX}/admin", AdminHandler, context),
        (rf"{PREFIX}/signout", SignOutHandler, context),
    ]
    return web.Application(
        routes, template_path=str(Path(__file__).with_name("templates")), login_url=f"{PREFIX}/signin",
        cookie_secret=registry.derived_secret("cookie"), xsrf_cookies=True,
        goblin_signin=signin, goblin_admins=context["admins"],
    )


def admin_of_request(app: web.Application, request) -> str | None:
    """The lab admin whose session cookie ``request`` carries (for pages outside ``app``), or None.

    The cookie's signature is checked first, so a forged or absent cookie costs no database look-up.
    """
    morsel = request.cookies.get(SESSION_COOKIE) if SESSION_COOKIE in request.headers.get("Cookie", "") else None
    if morsel is None:
        return None
    signin: SignIn = app.settings["goblin_signin"]
    token = web.decode_signed_value(app.settings["cookie_secret"], SESSION_COOKIE, morsel.value,
                                    max_age_days=signin.limits.session_ttl / 86400)
    if not token:
        return None
    email = signin.session_email(token.decode())
    return email if email in app.settings["goblin_admins"] else None
