"""Researcher access to a lab node: sign-in by e-mailed one-time code, access requests, approval.

The registry (:mod:`.registry`) keeps access requests in the node's state directory;
:mod:`.signin` turns one-time codes into sessions; :mod:`.web` serves the pages on the
scheduler's HTTP server (installed by ``scheduler_plugins.signin``).  Approving a
request issues a ``researcher`` credential under the lab's CA, the file that
``goblin_dask.connect(address, credential=PATH)`` takes.
"""

from goblin_dask.access.registry import AccessError, AccessRequest, ResearcherRegistry
from goblin_dask.access.signin import CodeRefused, RateLimited, SignIn, SignInLimits

__all__ = ["AccessError", "AccessRequest", "CodeRefused", "RateLimited", "ResearcherRegistry", "SignIn",
           "SignInLimits"]
