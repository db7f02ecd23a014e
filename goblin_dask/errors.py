"""Errors a user can meet on the way in, each with what it means and what to do, and its exit code.

One place decides whether a failure to reach or join a lab node can clear by retrying
(:func:`fatal_connect_error`): the volunteer agent's retry loop, :func:`goblin_dask.connect` and
``goblin doctor`` all ask it.  A fatal one ends the command at once with its own exit code
(docs/troubleshooting.md lists them); anything it does not name is transient and retried.
"""

from __future__ import annotations

#: Exit codes of the ``goblin`` commands, one per fatal cause (0: success, 1: click's usage and other errors).
EXIT_REFUSED = 2  # the lab node refused this credential (banned, malformed, not its lab's token)
EXIT_GAVE_UP = 3  # --max-attempts connection attempts failed (transient causes only)
EXIT_WRONG_SCHEME = 4  # tcp:// given, the lab node speaks TLS only
EXIT_OTHER_LAB = 5  # the credential was issued by another lab node (another CA)
EXIT_REVOKED = 6  # the credential was revoked on this lab node
EXIT_PORT_IN_USE = 7  # goblin node: a port it must listen on is taken
EXIT_WRONG_ROLE = 8  # a credential of another role (a volunteer's used to connect as a researcher)
EXIT_HOSTILE_LAB = 9  # goblin volunteer: the lab node named addresses a volunteer does not dial, or sent what no lab sends


class FatalConnectError(ConnectionError):
    """Connecting cannot succeed by trying again: ``str()`` says why and what to do; ``exit_code`` for the CLI."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def tls_address(address: str) -> str:
    """``address`` with the ``tls://`` scheme (what a lab node listens on)."""
    return "tls://" + address.split("://", 1)[-1]


def fatal_connect_error(address: str, error: BaseException | str) -> FatalConnectError | None:
    """The fatal cause of ``error`` (met connecting to or joining the lab node at ``address``), else None.

    Fatal: a non-TLS address (every lab node speaks TLS only), a credential of another lab (the node's
    certificate is not under the credential's CA), a revoked credential, a credential of the wrong role.
    Everything else (refused connections, timeouts, a node restarting) is transient.
    """
    text = str(error)
    scheme = address.split("://", 1)[0] if "://" in address else ""
    if (scheme and scheme != "tls") or "encryption required by Dask configuration" in text:
        return FatalConnectError(f"{address}: this lab node speaks TLS: use {tls_address(address)}", EXIT_WRONG_SCHEME)
    if "TLS certificate does not match" in text or "CERTIFICATE_VERIFY_FAILED" in text:
        return FatalConnectError(
            f"{address}: this credential was issued by another lab node (the node's certificate is not signed by "
            f"the credential's lab); use a credential from this node's admin, or the address of the lab that issued "
            f"it", EXIT_OTHER_LAB)
    if "was revoked" in text:
        return FatalConnectError(f"{address}: this credential was revoked by the lab; ask the lab's admin for a new "
                                 f"one", EXIT_REVOKED)
    if "is not allowed for volunteer" in text and "register-client" in text:
        return FatalConnectError(wrong_role_message("volunteer", address), EXIT_WRONG_ROLE)
    return None


def wrong_role_message(role: str, address: str) -> str:
    """Why a credential of ``role`` cannot open a researcher's session, and what to do."""
    return (f"{address}: goblin lab node: 'register-client' is not allowed for a {role} credential: a researcher "
            f"connects with a researcher credential (the lab's admin issues one: goblin researchers issue NAME)"
            + ("; a volunteer credential joins with `goblin volunteer ADDRESS --token ...`" if role == "volunteer" else ""))


class PortInUseError(OSError):
    """``goblin node``: a port it must listen on is taken (``exit_code``: :data:`EXIT_PORT_IN_USE`)."""

    exit_code = EXIT_PORT_IN_USE


def check_port_free(host: str, port: int, what: str, option: str) -> None:
    """Raise :class:`PortInUseError` naming ``what`` and the option that moves it when ``host:port`` is taken.

    Port 0 (any free one) is never taken.  A listening socket holds its port against this bind even with
    SO_REUSEADDR, as it does against the server's own bind.
    """
    import errno
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUseError(f"cannot listen on {host}:{port}: {e} (--host takes this machine's name or address)") \
            from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    why = "is in use" if e.errno == errno.EADDRINUSE else "needs privileges"
                    raise PortInUseError(f"{what} port {port} on {host} {why}: stop what holds it "
                                         f"(e.g. `ss -ltnp 'sport = :{port}'`) or pick another with {option}") \
                        from None
                if e.errno != errno.EADDRNOTAVAIL:  # e.g. an IPv6 address this machine lacks
                    raise
