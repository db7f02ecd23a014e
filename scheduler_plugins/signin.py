"""The researcher sign-in and access-request pages on the lab node's HTTP server (dashboard port).

Routes added after the Scheduler is built must go through ``http_application.add_application``
(``distributed.scheduler.http.routes`` is read in ``Scheduler.__init__``).
"""

from __future__ import annotations

import os


def install_signin(scheduler, state_dir: str | os.PathLike):
    """Serve ``/goblin/signin``, ``/goblin/access`` and ``/goblin/admin`` for the lab node of ``state_dir``.

    Returns the pages' tornado application (the dashboard guard checks admin sessions with it).
    """
    from goblin_dask.access.web import make_app

    app = make_app(state_dir)
    scheduler.http_application.add_application(app)
    return app
