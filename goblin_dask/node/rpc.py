"""The names of goblin's handlers and messages on the wire, in one place.

Scheduler handlers are installed by :mod:`scheduler_plugins` and :mod:`goblin_dask.link` and called
by the lab's processes, the lab admin, researchers and volunteers (who may call which:
:mod:`scheduler_plugins.admission`).  This module imports nothing: the scheduler plugins, the
volunteer agent and the validation checks all read it.
"""

# -- scheduler handlers ------------------------------------------------------------------------

#: The verification ledger's report (researchers may read it).
REPORT = "goblin_report"
#: The lab admin revokes a credential and disconnects its holder (``goblin revoke``, ``LabNode.revoke``).
REVOKE = "goblin_revoke"
#: The lab's own processes and the admin ban a volunteer, with the reason.
BAN = "goblin_ban"
#: The connected workers: address -> {"role", "name"}.
WORKERS = "goblin_workers"
#: The lab worker asks how to check one unverified result (replica / sample / Freivalds).
POLICY = "goblin_policy"
#: A volunteer asks which lab processes to keep standby connections to (:mod:`goblin_dask.link`).
LINK_ENDPOINTS = "goblin_link_endpoints"
#: A volunteer asks for its own record (credit, accepted, rejected, trust): ``goblin volunteer``'s status line.
VOLUNTEER_STATUS = "goblin_volunteer_status"
#: Any credential asks how the node sees it: its role, name, and whether it is revoked (``goblin doctor``).
CHECK_CREDENTIAL = "goblin_check_credential"
#: The lab worker reports a volunteer it refused on the comm layer (:mod:`goblin_dask.link`).
REFUSE_VOLUNTEER = "goblin_refuse_volunteer"
#: A researcher's Trainer reports a finished round (numbers only) for the lab's page
#: (:mod:`scheduler_plugins.training`); researchers and the lab may call it, volunteers may not.
TRAINING_ROUND = "goblin_training_round"

# -- messages on a volunteer's standby connection (:mod:`goblin_dask.link`) --------------------

#: A volunteer parks a connection at a lab process: ``{"op": STANDBY, "address": ...}``.
STANDBY = "goblin_standby"
#: The lab process takes a parked connection into use: ``{"op": ACTIVATE}``.
ACTIVATE = "goblin_activate"
#: Scheduler -> lab worker stream message: a volunteer was given tasks whose inputs the lab worker holds, and
#: may fetch them (``{"volunteer": name, "keys": [...]}``; goblin_dask.node.lab_worker).
MAY_FETCH = "goblin-may-fetch"


# -- calling a handler behind a check ----------------------------------------------------------


def handler_caller(handler):
    """``await call(comm, msg)``: ``handler`` called as distributed calls it (with the comm when its first
    parameter is named ``comm``; awaited when it returns an awaitable), for wrappers that check a call first."""
    import inspect

    expects_comm = next(iter(inspect.signature(handler).parameters), None) == "comm"

    async def call(comm, msg: dict):
        result = handler(comm, **msg) if expects_comm else handler(**msg)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call
