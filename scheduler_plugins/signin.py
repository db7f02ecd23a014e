"""The researcher sign-in and access-request pages on the lab node's HTTP server (dashboard port).

Routes added after the Scheduler is built must go through ``http_application.add_application``
(``distributed.scheduler.http.routes`` is read in ``Scheduler.__init__``).
"""

from __future__ import annotations

import os


def install_signin(scheduler, state_dir: str | os.PathLike) -> None:
    """Serve ``/goblin/signin``, ``/goblin/access`` and ``/goblin/admin`` for the lab node of ``state_dir``."""
    from goblin_dask.access.web import make_app

    scheduler.http_application.add_application(make_app(state_dir))
