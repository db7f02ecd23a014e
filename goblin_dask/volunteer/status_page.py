"""The volunteer's status and control page on 127.0.0.1, and ``goblin volunteer pause|resume|status``.

The page is the volunteer's own (never the lab's): it listens on the loopback only, every request
carries a token kept in the volunteer's state directory (0600 in a 0700 directory), and the host
must be 127.0.0.1 or localhost (no DNS rebinding).  The CLI's pause/resume/status find the running
agent through the files it writes there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from goblin_dask.credentials import _write_private
from goblin_dask.volunteer.agent import Agent, format_flops

logger = logging.getLogger(__name__)

#: Files of a running agent in its state directory (both 0600, the directory 0700; removed on exit).
CONTROL_FILE = "control.json"  # {"url", "pid", "name"}
TOKEN_FILE = "control-token"  # the token every request to the control page must carry


def default_state_dir(name: str) -> Path:
    """``$XDG_STATE_HOME/goblin-dask/volunteers/NAME`` (``~/.local/state/...``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "goblin-dask" / "volunteers" / name


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>goblin volunteer {name}</title><style>body{{font-family:sans-serif;margin:2em}}td{{padding:2px 12px}}</style>
</head><body><h1>goblin volunteer {name}</h1><table>{rows}</table>
<form method="post" action="/{action}"><input type="hidden" name="token" value="{token}">
<button type="submit">{action}</button></form>
<p>This machine computes only the operations of the lab's catalog (numeric kernels of goblin-dask) on the
numbers the lab sends, in memory; it runs no code of the lab's and writes none of its data to disk.</p>
</body></html>"""


def _control_app(agent: Agent, token: str, port_of):
    """The control page: ``/`` (HTML, ``?token=``), ``/api/status`` (JSON), ``POST /pause`` ``/resume``
    (or ``/api/pause``, ``/api/resume``); every request carries the token (``Authorization: Bearer`` or
    ``token=``) and names 127.0.0.1 or localhost as its host (no DNS rebinding)."""
    import hmac
    import html
    import json

    from tornado import web

    class Handler(web.RequestHandler):
        def prepare(self):
            host = (self.request.host or "").rsplit(":", 1)
            if host[0] not in ("127.0.0.1", "localhost") or (len(host) > 1 and host[1] != str(port_of())):
                raise web.HTTPError(403)
            header = self.request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else self.get_argument("token", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise web.HTTPError(403)

        def check_xsrf_cookie(self):  # the token is the check (a page elsewhere cannot know it)
            pass

        def set_default_headers(self):
            self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; "
                            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
            self.set_header("Referrer-Policy", "no-referrer")  # the page's address carries the token
            self.set_header("X-Content-Type-Options", "nosniff")

        def send_status(self):
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.write(json.dumps(agent.status()))

    class Page(Handler):
        def get(self):
            st = agent.status()
            gpu = st["limits"].get("gpu")
            gpu = f" (GPU {gpu['devices']}, memory pool limit {gpu['memory_limit'] or 'none'} B)" if gpu else ""
            rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in (
                ("state", st["state"]), ("lab", st["lab"]), ("tasks done", st["tasks_done"]),
                ("verified", f"{st['accepted']} accepted, {st['rejected']} rejected"),
                ("credit", format_flops(st["credit_flops"])), ("trust", st["trust"]),
                ("computing now", ", ".join(st["computing"]) or "-"),
                ("limits", f"{st['limits']['threads']} threads, memory {st['limits']['memory']}, "
                           f"{st['limits']['backend']}{gpu}")))
            self.set_header("Cache-Control", "no-store")
            self.write(_PAGE.format(name=html.escape(agent.name), rows=rows, token=html.escape(token),
                                    action="resume" if "you" in agent.paused_by else "pause"))

    class Status(Handler):
        def get(self):
            self.send_status()

    class Act(Handler):
        def post(self, action):
            agent.pause() if action == "pause" else agent.resume()
            if self.request.path.startswith("/api/"):
                self.send_status()
            else:
                self.redirect(f"/?token={token}")

    return web.Application([(r"/", Page), (r"/api/status", Status), (r"/(?:api/)?(pause|resume)", Act)])


class ControlPage:
    """The control page on 127.0.0.1, and its files in the volunteer's state directory."""

    def __init__(self, agent: Agent, state_dir: Path, port: int = 0):
        self.agent, self.state_dir, self.port = agent, Path(state_dir), port
        self.server = None

    def start(self) -> str:
        import json
        import secrets

        from tornado.httpserver import HTTPServer
        from tornado.netutil import bind_sockets

        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        token = secrets.token_urlsafe(32)
        sockets = bind_sockets(self.port, address="127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        self.server = HTTPServer(_control_app(self.agent, token, lambda: self.port))
        self.server.add_sockets(sockets)
        url = f"http://127.0.0.1:{self.port}"
        _write_private(self.state_dir / TOKEN_FILE, token + "\n")
        _write_private(self.state_dir / CONTROL_FILE, json.dumps({"url": url, "pid": os.getpid(),
                                                                  "name": self.agent.name}) + "\n")
        logger.info("status page: %s/?token=... (the token is in %s)", url, self.state_dir / TOKEN_FILE)
        return url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        for f in (CONTROL_FILE, TOKEN_FILE):
            (self.state_dir / f).unlink(missing_ok=True)
        try:
            self.state_dir.rmdir()  # when nothing else is kept there
        except OSError:
            pass


def control(action: str, state_dir: Path) -> dict:
    """``goblin volunteer pause|resume|status``: ask the agent running from ``state_dir``; returns its status."""
    import json
    import urllib.error
    import urllib.request

    try:
        info = json.loads((state_dir / CONTROL_FILE).read_text())
        token = (state_dir / TOKEN_FILE).read_text().strip()
    except (OSError, ValueError) as e:
        raise click.ClickException(f"no running volunteer in {state_dir} ({e})") from None
    path = "/api/status" if action == "status" else f"/api/{action}"
    req = urllib.request.Request(info["url"] + path, method="GET" if action == "status" else "POST", data=None,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError) as e:
        raise click.ClickException(f"the volunteer of {state_dir} does not answer at {info['url']}: {e}") from None


def _alive(control_file: Path) -> bool:
    """Is the agent that wrote ``control_file`` still running (a killed one leaves its files behind)?"""
    import json

    try:
        os.kill(int(json.loads(control_file.read_text())["pid"]), 0)
    except PermissionError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def find_state_dir(state_dir: str | None, name: str | None) -> Path:
    if state_dir:
        return Path(state_dir)
    if name:
        return default_state_dir(name)
    base = default_state_dir("x").parent
    running = sorted(p for p in base.glob(f"*/{CONTROL_FILE}") if _alive(p)) if base.is_dir() else []
    if len(running) == 1:
        return running[0].parent
    if not running:
        raise click.ClickException(f"no running volunteer under {base} (give --state-dir or --name)")
    names = ", ".join(p.parent.name for p in running)
    raise click.ClickException(f"several volunteers run here ({names}): say which with --name")
