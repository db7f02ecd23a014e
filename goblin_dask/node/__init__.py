"""The lab node's processes, one module per role.

* :mod:`~goblin_dask.node.scheduler`: the scheduler with the goblin plugins (``goblin node``), its state
  directory and node file;
* :mod:`~goblin_dask.node.lab_worker`: the trusted lab worker (``goblin lab-worker``);
* :mod:`~goblin_dask.node.local`: :class:`~goblin_dask.node.local.LabNode`, the whole grid on this machine,
  and :func:`~goblin_dask.node.local.connect` for researchers;
* :mod:`~goblin_dask.node.admin`: the lab admin's actions on a running node (revoke);
* :mod:`~goblin_dask.node.process`: what every grid process shares (signals, no spilling, stopping);
* :mod:`~goblin_dask.node.rpc`: the names of the goblin handlers on the wire.

Nothing is imported here: each process imports only its role's module.
"""
