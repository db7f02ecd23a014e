"""The volunteer link: one comm layer for what the lab reads from volunteers, and for volunteers behind NAT.

distributed chooses a comm class per address scheme; this module registers two backends
(``distributed.comm.registry.backends``) and keeps everything else distributed's own.

**Lab side** (the scheduler and the lab worker, :func:`install_lab_side`): the ``tls``
backend makes each connection's comm from its peer's certificate (the CA signed its
role).  A volunteer's connection is a :class:`VolunteerComm`; everyone else's is
distributed's ``TLS`` comm, unchanged.  A :class:`VolunteerComm`

* reads a message only when its announced size is within ``goblin.link.max-message``
  (default: a quarter of this machine's memory): a header announcing 100 GB allocates
  nothing and drops the connection; and only while the volunteer's unfinished messages across
  all its connections stay within ``goblin.link.max-in-flight`` (default: one largest message),
  so that 32 connections each one byte short of a whole message hold one buffer, not 32;
* decodes it with the plain-data allow-list (:func:`goblin_dask.safe_pickle.plain_data_loads`:
  numeric arrays, numbers, plain containers; no class, no function, no exception object)
  and without compressed frames, whatever the handler, the ``get_data`` answer or the
  worker stream it is for;
* refuses anything else: the connection is dropped, the refusal logged with the
  volunteer's name, and the volunteer banned (:func:`set_refusal_handler`).

A volunteer holds at most ``goblin.link.max-connections`` (32) connections to a lab
process at once, and a TLS handshake that does not finish in
``goblin.link.handshake-timeout`` (10 s) is dropped.

**Volunteers behind NAT.**  A volunteer opens no listening socket.  Its worker's
address is ``nat://<name>:<n>`` (``n`` tells its runs apart; no port is open).  The
:class:`NatListener` standing in for its listener keeps ``goblin.link.standby`` (2)
TLS connections open *from* the volunteer to each lab process that may need to reach
it (the scheduler, and the lab workers it learns from the scheduler's
``goblin_link_endpoints``), each announced with ``{"op": "goblin_standby"}``.  The lab
side parks them (:class:`Standby`: only under the name of the volunteer's own
certificate).  When a lab process connects to ``nat://...`` (the lab worker fetching a
result, the scheduler calling the worker), the ``nat`` connector takes a parked
connection, sends ``{"op": "goblin_activate"}``, and from there both ends run
distributed's own handshake and protocol with their roles swapped: the volunteer
serves it as if it had accepted it, and opens a new standby connection.  What it
costs: two idle TLS connections per lab process per volunteer, and one round trip
(the activation) the first time a lab process reaches a volunteer; distributed's
connection pool keeps an activated connection for reuse.

**What a volunteer dials and reads** (:func:`install_volunteer_side`): ``tls://`` addresses on the lab's host
(and ``goblin.link.lab-hosts``) only, whoever names them; messages within bounds checked before a buffer is
allocated; at most ``goblin.link.volunteer-connections`` open at a lab process for the lab to use.  A scheduler
naming anything else is the lab itself being hostile: the volunteer leaves it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import re
import struct
import time
import weakref
from collections import defaultdict, deque
from ssl import SSLError
from typing import Any, Callable

import dask
from distributed.comm.core import CommClosedError, Connector, FatalCommClosedError, Listener
from distributed.comm.registry import Backend, backends
from distributed.comm.tcp import (
    TLS,
    TLSBackend,
    TLSConnector,
    TLSListener,
    _close_comm,
    convert_stream_closed_error,
    get_stream_address,
    read_bytes_rw,
)

from distributed.comm.addressing import parse_address, parse_host_port, unparse_host_port
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.iostream import StreamClosedError

from goblin_dask import settings
from goblin_dask.node import rpc

logger = logging.getLogger("goblin_dask.link")

#: The volunteer (role, name) whose bytes this thread is decoding; None: a trusted peer's.
DECODING_FOR: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("goblin_decoding_for",
                                                                                      default=None)
#: Serializer families a volunteer's frames may use ("dask": numpy arrays by their dtype and shape).
VOLUNTEER_SERIALIZERS = ("dask", "pickle", "msgpack")
NAME = re.compile(r"^[\w-]+$")


class Refused(Exception):
    """A volunteer sent something the lab does not read; ``ban``: whether it is banned for it."""

    def __init__(self, reason: str, ban: bool = True):
        super().__init__(reason)
        self.reason, self.ban = reason, ban


# -- configuration ---------------------------------------------------------------------

def max_message() -> int:
    limit = settings.get("goblin.link.max-message")
    if limit is None:
        from distributed.system import MEMORY_LIMIT

        return int(MEMORY_LIMIT // 4)
    return int(dask.utils.parse_bytes(limit))


def max_in_flight() -> int:
    """``goblin.link.max-in-flight``: bytes of unfinished messages one volunteer may have across its
    connections to a lab process (null: :func:`max_message`, one largest message)."""
    limit = settings.get("goblin.link.max-in-flight")
    if limit is None:
        return max_message()
    value = int(dask.utils.parse_bytes(limit) if isinstance(limit, str) else limit)
    if value <= 0:
        raise ValueError(f"goblin.link.max-in-flight must be a positive number of bytes, got {limit!r}")
    return value


#: volunteer name -> bytes of the messages this process is reading from it now (all its connections)
_in_flight: dict[str, int] = {}


class ReadRate:
    """How fast this process reads each volunteer's messages, in bytes a second: a token bucket per name.

    A message is read whole and its bytes charged; a volunteer whose bucket is in debt has its next message
    read (on any of its connections) only once the debt is paid back, so its connections wait and TCP pushes
    back on the sender.  A refusal after the message was read and decoded is no defence against messages
    that are costly to decode (issue 29: 10 credentials sending ``who_has`` with 10,000 keys of 100
    characters kept a researcher's one-task job waiting over a second, refused or not).  Names are those of
    admitted certificates (the lab's CA signed them): the table grows with the volunteers enrolled."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens: dict[str, tuple[float, float]] = {}  # name -> (bytes, when counted)

    def _now(self, name: str) -> float:
        now = self.clock()
        tokens, then = self.tokens.get(name, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        self.tokens[name] = (tokens, now)
        return tokens

    def delay(self, name: str) -> float:
        """Seconds until ``name``'s next message may be read (0: now)."""
        tokens = self._now(name)
        return 0.0 if tokens >= 0 else -tokens / self.rate

    def charge(self, name: str, nbytes: int) -> None:
        tokens = self._now(name)
        self.tokens[name] = (tokens - nbytes, self.tokens[name][1])


def scheduler_read_rate() -> ReadRate:
    """``goblin.link.scheduler-read-rate`` (bytes a second, bursts of 8 seconds' worth) as a :class:`ReadRate`."""
    value = settings.get("goblin.link.scheduler-read-rate")
    rate = float(dask.utils.parse_bytes(value) if isinstance(value, str) else value)
    if rate <= 0:
        raise ValueError(f"goblin.link.scheduler-read-rate must be a positive number of bytes, got {value!r}")
    return ReadRate(rate, 8 * rate)


#: Set on the scheduler (:func:`install_scheduler_side`): how fast it reads each volunteer; None elsewhere
#: (the lab workers read the volunteers' results, which only max-in-flight bounds).
_read_rate: ReadRate | None = None


# -- refusals --------------------------------------------------------------------------

_refusal_handler: Callable[[str, str, bool], Any] | None = None


def set_refusal_handler(handler: Callable[[str, str, bool], Any] | None) -> None:
    """``handler(name, reason, ban)`` is called for each refusal (the scheduler bans through admission)."""
    global _refusal_handler
    _refusal_handler = handler


# -- banned and revoked volunteers ---------------------------------------------------------

#: Volunteer names this process reads nothing more from (banned or revoked): :func:`shut_out`.
_shut_out: set[str] = set()
#: Each volunteer's open connections to this process (accepted, activated standby, or dialled).
_volunteer_comms: dict[str, weakref.WeakSet] = defaultdict(weakref.WeakSet)
#: What a banned or revoked volunteer may still ask, on the scheduler only, to be told why it is refused:
#: one message of at most :data:`SHUT_OUT_MESSAGE` bytes on a new connection (its ``register-worker`` is
#: answered "banned" or "revoked", ``goblin doctor``'s check says so); then the connection is closed.
_told_when_shut_out: frozenset[str] = frozenset()
SHUT_OUT_MESSAGE = 256 * 2**10


def shut_out(names) -> int:
    """Read nothing more from volunteers ``names`` (banned or revoked): their open connections to this
    process are closed now (calls, worker stream, standby), and each new one is closed before its first
    message is read.  Returns how many open connections were closed."""
    closed = 0
    for name in names:
        name = str(name)
        _shut_out.add(name)
        for comm in list(_volunteer_comms.get(name, ())):
            if not comm.closed():
                comm.abort()
                closed += 1
    if closed:
        logger.info("closed %d connection(s) of banned or revoked volunteer(s) %s", closed, ", ".join(map(str, names)))
    return closed


def start_shut_out(names) -> None:
    """A lab node starts: exactly ``names`` are shut out (its revocation list; one lab node per process)."""
    _shut_out.clear()
    shut_out(names)


def is_shut_out(name: str) -> bool:
    return name in _shut_out


#: The scheduler's stream message telling a lab worker which volunteers are banned or revoked.
SHUT_OUT_OP = "goblin-shut-out"


def shut_out_handler(names=(), **ignored) -> None:
    """A lab worker's stream handler of :data:`SHUT_OUT_OP` (sent by the scheduler only)."""
    shut_out([str(n) for n in names or ()])


def nat_name(address: str) -> str | None:
    """The volunteer's name in its ``nat://NAME:N`` address, or None for another address (a lab process)."""
    return address[len("nat://"):].rsplit(":", 1)[0] if address.startswith("nat://") else None


def refuse(name: str, reason: str, ban: bool = True) -> None:
    logger.warning("refused volunteer %s: %s%s", name, reason, " (banned)" if ban else "")
    if _refusal_handler is not None:
        try:
            result = _refusal_handler(name, reason, ban)
            if asyncio.iscoroutine(result):
                asyncio.ensure_future(result)
        except Exception:
            logger.exception("goblin link: the refusal handler failed for %s", name)


# -- decoding ----------------------------------------------------------------------------

_installed_lab_side = False


def _install_decoding_hooks() -> None:
    """Route distributed's unpickling and decompression through the volunteer check."""
    import distributed.protocol.compression as compression
    import distributed.protocol.core as core
    import distributed.protocol.pickle as dpickle
    import distributed.protocol.serialize as serialize

    from goblin_dask.safe_pickle import plain_data_loads

    trusted_loads = dpickle.loads

    def loads(x, *, buffers=()):
        peer = DECODING_FOR.get()
        if peer is None:
            return trusted_loads(x, buffers=buffers)
        return plain_data_loads(x, buffers=buffers, peer=peer[1])

    trusted_decompress = compression.decompress

    def decompress(header, frames):
        if DECODING_FOR.get() is not None and any(c is not None for c in header.get("compression", ())):
            raise Refused("sent compressed frames (the lab reads none from volunteers)")
        return trusted_decompress(header, frames)

    dpickle.loads = loads
    compression.decompress = core.decompress = serialize.decompress = decompress


def _role_of(stream) -> tuple[str, str] | None:
    from goblin_dask.tls import cert_identity

    sock = getattr(stream, "socket", None)
    try:
        return cert_identity(sock.getpeercert() if sock is not None else None)
    except (OSError, ValueError):
        return None


class VolunteerComm(TLS):
    """The lab's end of a connection whose peer holds a volunteer certificate."""

    def __init__(self, stream, local_addr: str, peer_addr: str, deserialize: bool = True):
        super().__init__(stream, local_addr, peer_addr, deserialize=True)  # decoded here, under the allow-list
        from goblin_dask.tls import peer_identity

        self.identity = peer_identity(self) or ("volunteer", "?")  # TLS read the certificate already
        self.pushed_back: list = []
        self.limit = max_message()
        self.in_flight_limit = max_in_flight()
        self.reads_left = 0  # messages still read once its volunteer is shut out (the listener sets it)
        _volunteer_comms[self.volunteer].add(self)  # so that a ban closes it (:func:`shut_out`)

    @property
    def volunteer(self) -> str:
        return self.identity[1]

    async def read(self, deserializers=None):
        if self.pushed_back:
            return self.pushed_back.pop()
        stream = self.stream
        if stream is None:
            raise CommClosedError()
        if self.volunteer in _shut_out:
            if self.reads_left <= 0:
                self.abort()
                raise CommClosedError(f"goblin lab: volunteer {self.volunteer} is banned or revoked")
            self.reads_left -= 1
        limit = self.limit
        reserved = 0
        pace = _read_rate
        try:
            (size,) = struct.unpack("Q", await stream.read_bytes(8))
            if size > limit:
                raise Refused(f"announced a message of {size} bytes (this lab reads at most {limit})", ban=False)
            reserved += self._reserve(size)
            if pace is not None:
                if (wait := pace.delay(self.volunteer)) > 0:
                    await asyncio.sleep(wait)  # over its read rate: nothing more of it is read until then
                pace.charge(self.volunteer, size)
            whole = await read_bytes_rw(stream, size)
            try:
                from distributed.protocol.utils import unpack_frames

                frames, rest = unpack_frames(whole, partial=True)
            except Exception as e:
                raise Refused(f"sent a malformed frame header ({type(e).__name__})") from None
            if any(n < 0 for n in rest) or size + sum(rest) > limit:
                raise Refused(f"announced buffers of {sum(rest)} bytes (this lab reads at most {limit})", ban=False)
            reserved += self._reserve(sum(rest))
            if pace is not None:
                pace.charge(self.volunteer, sum(rest))
            for n in rest:
                frames.append(await read_bytes_rw(stream, n))
        except Refused as e:
            self._refuse(e)
        except BaseException as e:
            _end_read(self, e)
        finally:
            if reserved:
                left = _in_flight.get(self.volunteer, 0) - reserved
                if left > 0:
                    _in_flight[self.volunteer] = left
                else:
                    _in_flight.pop(self.volunteer, None)
        return await self._decode(frames)

    def _reserve(self, nbytes: int) -> int:
        """Count ``nbytes`` more of this volunteer's in flight (the buffer is allocated before its bytes
        arrive), or :class:`Refused` beyond ``goblin.link.max-in-flight`` across its connections: many
        connections each holding a message one byte short of complete would otherwise hold that many buffers."""
        held = _in_flight.get(self.volunteer, 0)
        if held + nbytes > self.in_flight_limit:
            raise Refused(f"announced {nbytes} bytes with {held} in flight on its other connections (this lab "
                          f"holds at most {self.in_flight_limit} per volunteer: goblin.link.max-in-flight)", ban=False)
        _in_flight[self.volunteer] = held + nbytes
        return nbytes

    async def _decode(self, frames):
        from distributed.protocol import loads
        from distributed.utils import nbytes, offload

        identity = self.identity

        def decode():
            token = DECODING_FOR.set(identity)
            try:
                return loads(frames, deserialize=True, deserializers=VOLUNTEER_SERIALIZERS)
            finally:
                DECODING_FOR.reset(token)

        try:
            if sum(map(nbytes, frames)) > 10_000_000:
                return text_errors_only(await offload(decode), self.volunteer)
            return text_errors_only(decode(), self.volunteer)
        except Refused as e:
            self._refuse(e)
        except Exception as e:  # a refused pickle, random bytes, a wrong structure ...
            from goblin_dask.safe_pickle import RefusedPickle

            cause = e if isinstance(e, RefusedPickle) else e.__cause__ or e
            what = f"a refused pickle: {cause}" if isinstance(cause, RefusedPickle) \
                else f"a malformed message ({type(e).__name__}: {str(e)[:200]})"
            self._refuse(Refused(f"sent {what}"))

    def _refuse(self, refusal: Refused):
        refuse(self.volunteer, refusal.reason, refusal.ban)
        self.abort()
        raise CommClosedError(f"goblin lab: refused volunteer {self.volunteer}: {refusal.reason}")


def _end_read(comm, error: BaseException):
    """A read of ``comm`` failed with ``error``: a closed stream raises distributed's CommClosedError; anything
    else (an OSError, a cancellation) aborts the connection, as distributed's own read does, and is raised."""
    if isinstance(error, (StreamClosedError, SSLError)):
        comm.stream = None
        comm._closed = True
        convert_stream_closed_error(comm, error)
    comm.abort()
    raise error


def text_errors_only(msg: Any, volunteer: str) -> Any:
    """A volunteer's errors as text: distributed unpickles ``exception``/``traceback`` bytes later,
    outside this comm (``clean_exception``, a researcher's client), and ``task-finished``'s ``type``."""
    for part in msg if isinstance(msg, (list, tuple)) else (msg,):
        if not isinstance(part, dict):
            continue
        if part.get("exception") is not None and not isinstance(part["exception"], str):
            text = part.get("exception_text")
            part["exception"] = text if isinstance(text, str) and text else f"an error on volunteer {volunteer}"
        if part.get("traceback") is not None and not isinstance(part["traceback"], str):
            part["traceback"] = None
        if part.get("op") == "task-finished" and part.get("type") is not None:
            part["type"] = None
    return msg


def _comm_for(stream, local_addr: str, peer_addr: str, deserialize: bool = True):
    """The comm of a lab process's TLS connection: chosen by the peer's certificate role."""
    identity = _role_of(stream)
    cls = VolunteerComm if identity is not None and identity[0] == "volunteer" else TLS
    return cls(stream, local_addr, peer_addr, deserialize)


# -- the lab side: listener, connector, standby connections --------------------------------

_handshaking = 0


class LabTLSConnector(TLSConnector):
    comm_class = staticmethod(_comm_for)


#: OpenSSL's reasons for a handshake that failed because one side's certificate is not under the other's CA:
#: the peer refused this lab's certificate (``...ALERT_UNKNOWN_CA``, ``...ALERT_BAD_CERTIFICATE``, and
#: ``...ALERT_DECRYPT_ERROR``: every goblin lab's CA has the same name, so the peer finds its own CA as the
#: issuer and the signature fails to verify) or this lab refused the peer's (``CERTIFICATE_VERIFY_FAILED``).
#: Either way the peer holds another lab's credential.
OTHER_CA_REASONS = ("UNKNOWN_CA", "BAD_CERTIFICATE", "DECRYPT_ERROR", "CERTIFICATE_VERIFY_FAILED")
#: OpenSSL's reasons for a first message that is no TLS at all: plain bytes (a tcp:// client), an HTTP request.
NOT_TLS_REASONS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "UNKNOWN_PROTOCOL",
                   "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE")
_ANY_CLIENT = ("nothing to do unless a volunteer or researcher cannot connect: `goblin doctor ADDRESS --credential "
               "FILE` says why")
#: Each kind of failed TLS handshake a lab process logs: its level, and its line, which says what happened and
#: what to do (``{address}``: the peer's; ``{reason}``: OpenSSL's).
HANDSHAKE_FAILURES: dict[str, tuple[int, str]] = {
    "other-lab": (logging.WARNING,
                  "refused a TLS connection from {address}: its certificate is not signed by this lab's CA ({reason}): "
                  "it holds another lab's credential, and needs one from this lab (`goblin enroll`, `goblin "
                  "researchers issue`)"),
    "not-tls": (logging.WARNING,
                "refused a TLS connection from {address}: it does not speak TLS ({reason}): volunteers and researchers "
                "reach this lab node at its tls:// address, never tcp:// (and a browser reaches the lab page on the "
                "dashboard port)"),
    "no-certificate": (logging.WARNING,
                       "refused a TLS connection from {address}: it sent no certificate ({reason}): volunteers and "
                       "researchers need a credential of this lab (`goblin enroll`, `goblin researchers issue`), given "
                       "as `--token FILE` or `credential=PATH`"),
    "timeout": (logging.INFO,
                "a TLS handshake from {address} did not finish within goblin.link.handshake-timeout ({reason} s): a "
                "slow or lost link, or a client that is not goblin's; " + _ANY_CLIENT),
    "other": (logging.INFO,
              "a TLS handshake from {address} failed ({reason}): the client closed it or lost its connection, or is "
              "not a goblin client (a port scan, a load balancer's probe); " + _ANY_CLIENT),
}


def handshake_failure(error: BaseException | None) -> str:
    """The kind (a key of :data:`HANDSHAKE_FAILURES`) of a failed TLS handshake's ``error``."""
    if isinstance(error, asyncio.TimeoutError):
        return "timeout"
    reason = str(getattr(error, "reason", None) or error or "").upper()
    if isinstance(error, SSLError):
        if any(r in reason for r in OTHER_CA_REASONS):
            return "other-lab"
        if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason:
            return "no-certificate"
        if any(r in reason for r in NOT_TLS_REASONS):
            return "not-tls"
    return "other"


class HandshakeLog:
    """Says on the lab process's log, as one line, that a TLS handshake of one kind failed (see
    :data:`HANDSHAKE_FAILURES`), with the peer's address; at most one line per
    ``goblin.link.handshake-log-interval`` seconds, the next one counting those held back, so that an agent
    retrying (or a flood) cannot fill the log.  Without it the node says nothing about most of them:
    tornado's own "SSL Error" line is silenced by distributed's logging config."""

    MAX_ADDRESSES = 1024

    def __init__(self, kind: str, clock: Callable[[], float] = time.monotonic, *,
                 level_line: tuple[int, str] | None = None):
        self.level, self.line = level_line or HANDSHAKE_FAILURES[kind]
        self.clock = clock
        self.last: float | None = None
        self.held, self.held_from = 0, set()

    def failed(self, address: str, reason: object) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < float(settings.get("goblin.link.handshake-log-interval")):
            self.held += 1
            if len(self.held_from) < self.MAX_ADDRESSES:  # a count, so a flood from many addresses stays small
                try:
                    self.held_from.add(parse_host_port(parse_address(address)[1])[0])
                except ValueError:
                    self.held_from.add(address)
            return
        many = "+" if len(self.held_from) >= self.MAX_ADDRESSES else ""
        held = (f" ({self.held} more since the last such line, from {len(self.held_from)}{many} address(es))"
                if self.held else "")
        logger.log(self.level, "%s%s", self.line.format(address=address, reason=reason), held)
        self.last, self.held, self.held_from = now, 0, set()


HANDSHAKE_LOGS = {kind: HandshakeLog(kind) for kind in HANDSHAKE_FAILURES}


def log_handshake_failure(address: str, error: BaseException) -> None:
    """One failed TLS handshake with ``address`` on the log, as its kind's :class:`HandshakeLog` allows."""
    kind = handshake_failure(error)
    reason = (settings.get("goblin.link.handshake-timeout") if kind == "timeout"
              else getattr(error, "reason", None) or str(error) or type(error).__name__)
    HANDSHAKE_LOGS[kind].failed(address, reason)


class LabTLSListener(TLSListener):
    comm_class = staticmethod(_comm_for)

    async def _prepare_stream(self, stream, address):
        global _handshaking
        if _handshaking >= int(settings.get("goblin.link.max-handshakes")):
            stream.close()
            return None
        _handshaking += 1
        try:
            await asyncio.wait_for(stream.wait_for_handshake(), float(settings.get("goblin.link.handshake-timeout")))
        except (OSError, asyncio.TimeoutError) as e:
            log_handshake_failure(address, getattr(e, "real_error", None) or e)
            stream.close()
            return None
        finally:
            _handshaking -= 1
        return stream

    async def _handle_stream(self, stream, address):
        address = self.prefix + unparse_host_port(*address[:2])
        stream = await self._prepare_stream(stream, address)
        if stream is None:
            return
        if self.tcp_server is None:
            stream.close()
            return
        comm = self.comm_class(stream, self.prefix + get_stream_address(stream), address, self.deserialize)
        comm.allow_offload = self.allow_offload
        if isinstance(comm, VolunteerComm):
            shut_out = comm.volunteer in _shut_out
            if shut_out and not _told_when_shut_out:  # banned or revoked: not one byte of it is read
                logger.info("closed a connection of banned or revoked volunteer %s from %s", comm.volunteer, address)
                comm.abort()
                return
            if shut_out:  # distributed's handshake, then one small message: the one that tells it why
                comm.reads_left, comm.limit = 2, min(comm.limit, SHUT_OUT_MESSAGE)
            held, most = _volunteer_comms[comm.volunteer], int(settings.get("goblin.link.max-connections"))
            if sum(1 for c in held if not c.closed() and c is not comm) >= most:
                refuse(comm.volunteer, f"opened more than {most} connections", ban=False)
                comm.abort()
                return
        try:
            await self.on_connection(comm)
        except CommClosedError:
            return
        if isinstance(comm, VolunteerComm):
            try:
                first = await comm.read()
            except (CommClosedError, OSError):
                return
            if comm.volunteer in _shut_out and not (isinstance(first, dict) and first.get("op") in _told_when_shut_out):
                logger.info("closed a connection of banned or revoked volunteer %s from %s", comm.volunteer, address)
                comm.abort()
                return
            if isinstance(first, dict) and first.get("op") == rpc.STANDBY:
                STANDBY.park(comm, first.get("address"))
                return
            comm.pushed_back.append(first)
        await self.comm_handler(comm)


class Standby:
    """Connections volunteers opened to this lab process, parked until it needs to reach them."""

    def __init__(self):
        self.parked: dict[str, deque] = defaultdict(deque)
        self.waiting: dict[str, list[asyncio.Future]] = defaultdict(list)

    def park(self, comm: VolunteerComm, address: Any) -> None:
        try:
            scheme, loc = parse_address(address) if isinstance(address, str) else (None, "")
            host, _ = parse_host_port(loc)
        except (ValueError, TypeError):
            scheme, host = None, None
        if scheme != "nat" or host != comm.volunteer:
            refuse(comm.volunteer, f"offered a standby connection for {str(address)[:100]!r}, not its own name")
            comm.abort()
            return
        address = f"nat://{loc}"
        for fut in self.waiting.get(address, ()):
            if not fut.done():
                fut.set_result(comm)
                return
        queue = self.parked[address]
        live = [c for c in queue if not c.closed()]
        queue.clear()
        queue.extend(live)
        while len(queue) >= int(settings.get("goblin.link.max-standby")):
            queue.popleft().abort()
        queue.append(comm)

    async def take(self, address: str) -> VolunteerComm:
        queue = self.parked.get(address)
        while queue:
            comm = queue.popleft()
            if not comm.closed():
                return comm
        fut = asyncio.get_running_loop().create_future()
        self.waiting[address].append(fut)
        try:
            return await fut
        finally:
            self.waiting[address].remove(fut)
            if not self.waiting[address]:
                del self.waiting[address]


STANDBY = Standby()


class NatConnector(Connector):
    """Reaches a volunteer through a connection it parked here."""

    async def connect(self, address, deserialize=True, **connection_args):
        name = parse_host_port(address)[0]
        if name in _shut_out:
            raise OSError(f"goblin lab: volunteer {name} is banned or revoked")
        comm = await STANDBY.take(f"nat://{address}")
        try:
            await comm.write({"op": rpc.ACTIVATE})
        except Exception:
            comm.abort()
            raise
        comm._peer_addr = f"nat://{address}"
        return comm


class LabTLSBackend(TLSBackend):
    _connector_class = LabTLSConnector
    _listener_class = LabTLSListener


class HostPortBackend(Backend):
    """A backend whose addresses are ``HOST:PORT`` as written (nothing to resolve, no local address)."""

    def get_address_host(self, loc):
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc):
        return parse_host_port(loc)

    def resolve_address(self, loc):
        return loc

    def get_local_address_for(self, loc):
        return ""


class NatBackend(HostPortBackend):
    """``nat://<name>:<n>``: a volunteer reached over connections it opened itself."""

    def get_connector(self):
        return NatConnector()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        return NatListener(loc, handle_comm, deserialize, **connection_args)


def install_lab_side() -> None:
    """Make this process a lab process: volunteers' bytes decoded as data only, NAT volunteers reachable."""
    global _installed_lab_side
    if _installed_lab_side:
        return
    _install_decoding_hooks()
    backends["tls"] = LabTLSBackend()
    backends["nat"] = NatBackend()
    _installed_lab_side = True


def stream_interval() -> float:
    """``goblin.link.stream-interval``: seconds a process gathers control messages before sending them.

    distributed batches a stream's messages for 5 ms (scheduler to worker) and 2 ms (worker to
    scheduler); each hop of a chain of dependent tasks (a model's layers: product on a volunteer,
    check and glue on the lab worker, the next product) waits up to both.  Measured on a captured
    GPT forward (217 tasks, ~50 hops in a row): 1 ms on both sides, 11-20 % more passes a second.
    """
    value = float(settings.get("goblin.link.stream-interval"))
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"goblin.link.stream-interval must be between 0 and 1 second, got {value}")
    return value


def tune_worker_stream(worker) -> None:
    """A worker's (lab worker's or volunteer's) stream to the scheduler batches for :func:`stream_interval`."""
    worker.batched_stream.interval = stream_interval()


class StreamInterval(SchedulerPlugin):
    """The scheduler's stream to each worker batches for :func:`stream_interval` (set as it joins)."""

    name = "goblin-stream-interval"

    def __init__(self):
        self.interval = stream_interval()

    def add_worker(self, scheduler, worker: str) -> None:
        stream = scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.interval = self.interval


def dead_after() -> float:
    """``goblin.link.dead-after``: seconds without a heartbeat after which a volunteer is taken for gone."""
    value = float(settings.get("goblin.link.dead-after"))
    if not value > 0:
        raise ValueError(f"goblin.link.dead-after must be a number of seconds above 0, got {value}")
    return value


def heartbeat() -> float:
    """``goblin.link.heartbeat``: seconds between a volunteer's heartbeats (read once, at the node's start)."""
    value = float(settings.get("goblin.link.heartbeat"))
    if not 0.0 < value <= 60.0:
        raise ValueError(f"goblin.link.heartbeat must be between 0 and 60 seconds, got {value}")
    return value


def volunteer_heartbeat(workers: int, beat: float | None = None) -> float:
    """Seconds between a volunteer's heartbeats on a grid of ``workers`` workers: ``beat`` (default
    :func:`heartbeat`), or distributed's own interval where that is longer (0.5 s up to 10 workers, ...,
    n/200 + 1 s above 200).

    Each heartbeat costs the scheduler about 1 ms of CPU (measured: 2.1 ms/s per idle volunteer at distributed's
    0.5 s); a volunteer's state changes (paused, tasks done) travel on its stream, not in heartbeats, so a
    slower beat only makes a silent one noticed later, which ``dead-after`` bounds anyway."""
    from distributed.scheduler import heartbeat_interval

    return max(heartbeat() if beat is None else beat, heartbeat_interval(workers))


def silence_limit(dead_after_s: float, workers: int, beat: float) -> float:
    """Seconds of silence that make a volunteer gone: ``dead_after_s``, and never under three of its
    heartbeat intervals (:func:`volunteer_heartbeat`): a large lab's volunteers heartbeat less often, and
    are not dead for it."""
    return max(float(dead_after_s), 3 * volunteer_heartbeat(workers, beat))


class SilentVolunteers:
    """A volunteer not heard from for ``goblin.link.dead-after`` seconds is removed; its tasks are reissued.

    A home link that drops (a router that reboots, a laptop that sleeps) sends no FIN: the lab's
    connections to that volunteer stay open, and distributed's own worker TTL (5 minutes, checked every
    5 minutes) is the only thing that ends them, while every task the volunteer held waits.  Checked
    four times per ``dead-after`` (a volunteer is gone between 1 and 1.25 times it); removed as a lost
    worker (:mod:`scheduler_plugins.faults` counts it like a crash).  When the scheduler itself stalled
    (a check ran more than two intervals after the one before: a huge graph, a swapping machine), the
    heartbeats that arrived meanwhile are still unread: every volunteer gets a fresh ``dead-after`` from then.
    Likewise a volunteer the scheduler is not reading, over its ``goblin.link.scheduler-read-rate`` (an honest
    one that sent more than a burst at once): its heartbeats wait unread on the lab's side, so its silence is
    counted from when the lab last held it back.
    """

    def __init__(self, scheduler, admission):
        from tornado.ioloop import PeriodicCallback

        self.scheduler, self.admission = scheduler, admission
        self.dead_after = dead_after()
        self.interval = self.dead_after / 4
        self.removed: list[dict[str, Any]] = []  # {"name", "address", "silent"}: the latest ones
        self.heard_since = time.time()  # silence is counted from no earlier than this (the last stall's end)
        #: volunteer name -> when the scheduler last held its messages back (over its read rate, :class:`ReadRate`)
        self.held_back_at: dict[str, float] = {}
        self.last_check: float | None = None
        self.callback = PeriodicCallback(self.check, self.interval * 1000)

    def silent(self, now: float | None = None) -> dict[str, float]:
        """Connected volunteers past the limit: address -> seconds since their last heartbeat."""
        now = time.time() if now is None else now
        workers = self.scheduler.workers
        limit = silence_limit(self.dead_after, len(workers), self.admission.heartbeat)
        found = {}
        pace = _read_rate
        for address in self.admission.volunteers():
            ws = workers.get(address)
            if ws is None:
                continue
            name = self.admission.names.get(address)
            if pace is not None and name is not None and pace.delay(name) > 0:
                self.held_back_at[name] = now  # its heartbeats wait on this side, unread: not silent
                continue
            if now - max(ws.last_seen, self.heard_since, self.held_back_at.get(name, 0.0)) > limit:
                found[address] = now - ws.last_seen
        for name in [n for n, t in self.held_back_at.items() if now - t > limit]:
            del self.held_back_at[name]
        return found

    async def check(self) -> None:
        now = time.time()
        gap = now - self.last_check if self.last_check is not None else 0.0
        self.last_check = now
        if gap > 2 * self.interval:
            logger.warning("the scheduler did not run its silence check for %.0f s: every volunteer's silence "
                           "is counted from now", gap)
            self.heard_since = now
            return
        for address, silent in self.silent(now).items():
            name = self.admission.names.get(address, "?")
            logger.warning("volunteer %s at %s silent for %.0f s (goblin.link.dead-after %g s): removed, its tasks "
                           "reissued", name, address, silent, self.dead_after)
            self.removed.append({"name": name, "address": address, "silent": round(silent, 1)})
            del self.removed[:-100]
            await self.scheduler.remove_worker(address, stimulus_id=f"goblin-silent-{name}-{time.time()}",
                                               close=True, expected=False)


def install_scheduler_side(scheduler, admission) -> None:
    """The scheduler's link handlers, its refusals recorded (and bans made) by admission, its
    streams' batching interval (:class:`StreamInterval`), and its watch for volunteers gone silent
    (:class:`SilentVolunteers`, started with the scheduler's periodic callbacks).

    ``goblin_link_endpoints`` (volunteers): the lab processes a volunteer keeps standby
    connections to.  ``goblin_refuse_volunteer`` (the lab worker): a refusal it made.
    """
    from scheduler_plugins.admission import _authorized

    def link_endpoints() -> list[str]:
        return [scheduler.address, *sorted(admission.lab_workers())]

    def refuse_volunteer(name: str, reason: str, ban: bool = True) -> None:
        admission.refuse_volunteer(str(name), str(reason), bool(ban))

    for op, handler in ((rpc.LINK_ENDPOINTS, link_endpoints), (rpc.REFUSE_VOLUNTEER, refuse_volunteer)):
        scheduler.handlers[op] = _authorized(op, handler, admission.volunteer_call)
    set_refusal_handler(admission.refuse_volunteer)
    global _told_when_shut_out, _read_rate
    from scheduler_plugins.admission import SHUT_OUT_TOLD

    _told_when_shut_out = SHUT_OUT_TOLD
    _read_rate = scheduler_read_rate()
    scheduler.add_plugin(StreamInterval())
    silent = SilentVolunteers(scheduler, admission)
    scheduler.periodic_callbacks["goblin-silent-volunteers"] = silent.callback


# -- the volunteer side ----------------------------------------------------------------------
#
# A volunteer is a person's machine, and the lab node (or whoever holds the lab's CA) must not be able to use
# it against its own network: it dials only ``tls://`` addresses on the lab's host (the host it was told to
# join, or the address its connections there reached) and ``goblin.link.lab-hosts``; it reads bounded messages
# from the lab; and it keeps a bounded number of connections open for the lab to use.

#: Hosts this volunteer may dial (lower-case, no brackets): the lab's it joined and the IPs that reached.
_lab_hosts: set[str] = set()
#: Hosts given as the lab's address (``goblin volunteer tls://HOST:PORT``): the IPs reached there are the lab's too.
_joined_hosts: set[str] = set()
#: Largest message of the scheduler's answer naming the lab's endpoints, and of a standby connection's
#: first message (``goblin_activate``): an honest one is a few hundred bytes.
ENDPOINTS_MESSAGE = 64 * 2**10
STANDBY_MESSAGE = 4 * 2**10
#: Longest endpoint address a volunteer reads (a host name is at most 253 characters).
MAX_ENDPOINT = 300


class LabSent(CommClosedError):
    """A lab process sent what this volunteer does not read (``reason`` names it); the connection is closed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


#: One line per ``goblin.link.handshake-log-interval`` seconds on the volunteer's log about what it refused
#: of the lab's (the next counts those held back): a lab cannot fill a lender's disk with them.
REFUSAL_LOG = HandshakeLog("other", level_line=(logging.WARNING, "refused what lab process {address} sent: {reason}"))


def _norm_host(host: str) -> str:
    return host.strip("[]").lower()


def join_lab(address: str) -> None:
    """This volunteer joins the lab node at ``address``: its host is the lab's."""
    try:
        host = _norm_host(parse_host_port(parse_address(address)[1])[0])
    except ValueError:
        return  # no lab to join there: connecting says why
    _joined_hosts.add(host)
    _lab_hosts.add(host)


def lab_host(value: str) -> str:
    """``value`` as ``goblin.link.lab-hosts`` holds it (``goblin volunteer --lab-host``): a host name, an IP
    address, a network such as 10.0.0.0/24, or ``*``; a ValueError saying so for anything else (an address
    with a scheme or port would never match, and the lab worker it was meant for would never be dialled)."""
    import ipaddress

    host = _norm_host(str(value).strip())
    if host == "*":
        return host
    try:
        return str(ipaddress.ip_network(host, strict=False) if "/" in host else ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if "/" not in host and len(host) <= 253 and all(
            0 < len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum() for label in labels):
        return host
    raise ValueError(f"{str(value)[:MAX_ENDPOINT]!r} is not a host: give a name, an IP address or a network such as "
                     f"10.0.0.0/24 ('*': any host), without a scheme or port")


def allow_lab_hosts(hosts) -> None:
    """Add ``hosts`` (:func:`lab_host` values: ``goblin volunteer --lab-host``) to this process's
    ``goblin.link.lab-hosts``, beside those its config and environment name."""
    if hosts:
        dask.config.set({"goblin.link.lab-hosts": [*(settings.get("goblin.link.lab-hosts") or ()), *hosts]})


def dial_refusal(address: str) -> str | None:
    """Why this volunteer does not dial ``address`` (None: it does): a scheme other than ``tls://``, or a host
    other than the lab's and those of ``goblin.link.lab-hosts`` (names, IPs or networks such as 10.0.0.0/24;
    ``*``: any host)."""
    import ipaddress

    try:
        scheme, loc = parse_address(address, strict=True)
        host = _norm_host(parse_host_port(loc)[0])
    except (ValueError, TypeError) as e:
        return f"not an address ({e})"
    if scheme != "tls":
        return f"its scheme is {scheme}://: a volunteer dials tls:// only"
    if host in _lab_hosts:
        return None
    for allowed in settings.get("goblin.link.lab-hosts") or ():
        allowed = _norm_host(str(allowed))
        if allowed in ("*", host):
            return None
        try:
            if "/" in allowed and ipaddress.ip_address(host) in ipaddress.ip_network(allowed, strict=False):
                return None
        except ValueError:
            continue
    return (f"{host[:MAX_ENDPOINT]} is not the lab's host ({', '.join(sorted(_lab_hosts)) or 'none yet'}); a lab process on "
            f"another host is dialled only when goblin.link.lab-hosts (goblin volunteer --lab-host) names it")


class LabPeerComm(TLS):
    """A volunteer's end of a TLS connection to a lab process: it reads a message only when its announced size
    is within ``limit`` (default ``goblin.link.max-message``; smaller on standby and endpoint connections), and
    drops the connection otherwise, before a buffer is allocated or a handler runs."""

    def __init__(self, stream, local_addr: str, peer_addr: str, deserialize: bool = True):
        super().__init__(stream, local_addr, peer_addr, deserialize)
        self.limit = max_message()
        self.gone = asyncio.Event()  # set once the connection is closed, by either end
        ref = weakref.ref(self)

        def on_close():
            _close_comm(ref)  # distributed's own
            comm = ref()
            if comm is not None:
                comm.gone.set()

        stream.set_close_callback(on_close)

    async def read(self, deserializers=None):
        from distributed.comm import tcp  # its from_frames, as distributed's own TLS read calls it
        from distributed.protocol.utils import unpack_frames

        stream, limit = self.stream, self.limit
        if stream is None:
            raise CommClosedError()
        try:
            (size,) = struct.unpack("Q", await stream.read_bytes(8))
            if size > limit:
                raise LabSent(f"a message of {size} bytes announced (this volunteer reads at most {limit} here)")
            try:
                frames, rest = unpack_frames(await read_bytes_rw(stream, size), partial=True)
            except Exception as e:
                raise LabSent(f"a malformed frame header ({type(e).__name__})") from None
            if any(n < 0 for n in rest) or size + sum(rest) > limit:
                raise LabSent(f"buffers of {sum(rest)} bytes announced (this volunteer reads at most {limit} here)")
            for n in rest:
                frames.append(await read_bytes_rw(stream, n))
        except LabSent as e:
            REFUSAL_LOG.failed(self.peer_address, e.reason)
            self.abort()
            raise
        except BaseException as e:
            _end_read(self, e)
        try:
            return await tcp.from_frames(frames, deserialize=self.deserialize, deserializers=deserializers,
                                         allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError("aborted stream on truncated data") from None


class VolunteerTLSConnector(TLSConnector):
    """A volunteer's dials: refused off the lab's host (:func:`dial_refusal`), before any packet leaves."""

    comm_class = LabPeerComm

    async def connect(self, address, deserialize=True, **connection_args):
        why = dial_refusal("tls://" + address)
        if why is not None:
            REFUSAL_LOG.failed("tls://" + str(address)[:MAX_ENDPOINT], f"not dialled: {why}")
            raise FatalCommClosedError(f"goblin volunteer: not dialling tls://{str(address)[:MAX_ENDPOINT]}: {why}")
        comm = await super().connect(address, deserialize, **connection_args)
        if _norm_host(parse_host_port(address)[0]) in _joined_hosts:  # the IP the lab's name actually reached
            try:
                _lab_hosts.add(_norm_host(comm.stream.socket.getpeername()[0]))
            except (AttributeError, OSError, IndexError):
                pass
        return comm


class VolunteerTLSBackend(TLSBackend):
    _connector_class = VolunteerTLSConnector


class RefusedConnector(Connector):
    """A volunteer dials no address of this scheme (tcp://, ws://, nat://, ...), whoever names it."""

    def __init__(self, scheme: str):
        self.scheme = scheme

    async def connect(self, address, deserialize=True, **connection_args):
        why = f"its scheme is {self.scheme}://: a volunteer dials tls:// only"
        REFUSAL_LOG.failed(f"{self.scheme}://{str(address)[:MAX_ENDPOINT]}", f"not dialled: {why}")
        raise FatalCommClosedError(f"goblin volunteer: not dialling {self.scheme}://{str(address)[:MAX_ENDPOINT]}: {why}")


class VolunteerNatBackend(NatBackend):
    """The volunteer's own ``nat://`` listener; it reaches no ``nat://`` address (another volunteer's)."""

    def get_connector(self):
        return RefusedConnector("nat")


class RefusedBackend(HostPortBackend):
    """A scheme a volunteer neither dials nor listens on."""

    def __init__(self, scheme: str):
        self.scheme = scheme

    def get_connector(self):
        return RefusedConnector(self.scheme)

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        raise ValueError(f"goblin volunteer: no {self.scheme}:// listener (a volunteer listens on nat:// only)")


#: Schemes distributed knows besides tls and nat: a volunteer dials none of them.
REFUSED_SCHEMES = ("tcp", "inproc", "ws", "wss", "ucx", "ucxx")

#: Set by the agent (:func:`on_hostile_lab`): called with what the scheduler sent that no lab sends.
_hostile_lab_handler: Callable[[str], Any] | None = None


def on_hostile_lab(handler: Callable[[str], Any] | None) -> None:
    """``handler(reason)`` is called when the scheduler itself names what this volunteer does not dial: it
    leaves that lab (``goblin volunteer`` exits naming ``reason``)."""
    global _hostile_lab_handler
    _hostile_lab_handler = handler


def max_endpoints() -> int:
    return max(1, int(settings.get("goblin.link.max-endpoints")))


def endpoints_refusal(found: Any) -> str | None:
    """Why the scheduler's answer naming the lab's endpoints is none a lab sends (None: it is one): not a
    list, more than ``goblin.link.max-endpoints`` entries, an entry that is no string or is too long, or
    an address this volunteer does not dial (:func:`dial_refusal`)."""
    if not isinstance(found, (list, tuple)):
        return f"a {type(found).__name__} where a list of addresses belongs"
    if len(found) > max_endpoints():
        return f"{len(found)} endpoints (this volunteer keeps at most goblin.link.max-endpoints = {max_endpoints()})"
    for endpoint in found:
        if not isinstance(endpoint, str):
            return f"an endpoint that is a {type(endpoint).__name__}, not an address"
        if len(endpoint) > MAX_ENDPOINT:
            return f"an endpoint of {len(endpoint)} characters ({endpoint[:60]!r}...)"
        why = dial_refusal(endpoint)
        if why is not None:
            return f"endpoint {endpoint!r}: {why}"
    return None


class NatListener(Listener):
    """A volunteer's listener that opens no socket: it keeps standby connections to the lab."""

    prefix = "nat://"

    def __init__(self, loc: str, handle_comm, deserialize: bool = True, allow_offload: bool = True, *,
                 goblin_lab: str | None = None, goblin_dial: dict | None = None, **ignored: Any):
        host, port = parse_host_port(loc, 0) if loc else ("", 0)
        if not NAME.match(host or ""):
            raise ValueError(f"nat listener: {host!r} is not a volunteer name (letters, digits, '-', '_')")
        if goblin_lab is None or goblin_dial is None:
            raise ValueError("nat listener: needs the lab node's address and connection arguments")
        self.name = host
        self.port = port or random.randint(1024, 65535)
        self.comm_handler = handle_comm
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.lab = goblin_lab
        self.dial = goblin_dial
        self.keepers: dict[str, asyncio.Task] = {}
        self.serving: set[asyncio.Task] = set()
        self.standby: set = set()
        self._refresher: asyncio.Task | None = None
        join_lab(goblin_lab)

    @property
    def listen_address(self) -> str:
        return f"nat://{self.name}:{self.port}"

    contact_address = listen_address

    def get_host_port(self):
        return self.name, self.port

    async def start(self) -> None:
        self._keep(self.lab)
        self._refresher = asyncio.create_task(self._refresh_endpoints())

    def stop(self) -> None:
        for task in [*self.keepers.values(), *self.serving, *([self._refresher] if self._refresher else [])]:
            task.cancel()
        for comm in list(self.standby):
            comm.abort()
        self.keepers.clear()

    def _keep(self, endpoint: str) -> None:
        if endpoint not in self.keepers:
            self.keepers[endpoint] = asyncio.create_task(self._keep_standby(endpoint))

    async def _refresh_endpoints(self) -> None:
        """Follow the lab processes the scheduler names (a lab worker may join or restart).

        One connection asks, every ``goblin.link.refresh`` seconds, for as long as it lasts: a new one
        each time cost the scheduler a TLS handshake per volunteer every 5 s (1.2 ms of its CPU a second
        per idle volunteer, measured with 4).  An answer no lab sends (:func:`endpoints_refusal`, or over
        :data:`ENDPOINTS_MESSAGE` bytes) comes from the lab itself: this volunteer leaves it."""
        from distributed.comm import connect

        comm = None
        try:
            while True:
                try:
                    if comm is None or comm.closed():
                        comm = await connect(self.lab, timeout=10, **self.dial)
                        comm.limit = ENDPOINTS_MESSAGE
                    await comm.write({"op": rpc.LINK_ENDPOINTS, "reply": True})
                    found = await asyncio.wait_for(comm.read(), 10)
                    why = endpoints_refusal(found)
                    if why is not None:
                        raise LabSent(why)
                    self._follow(found)
                except asyncio.CancelledError:
                    raise
                except LabSent as e:
                    self._leave(f"the lab node at {self.lab} answered {rpc.LINK_ENDPOINTS} with {e.reason}")
                    return
                except Exception as e:
                    logger.debug("could not refresh the lab's endpoints: %s", e)
                    if comm is not None:
                        comm.abort()
                        comm = None
                await asyncio.sleep(float(settings.get("goblin.link.refresh")))
        finally:
            if comm is not None:
                comm.abort()

    def _leave(self, reason: str) -> None:
        logger.error("%s: leaving this lab", reason)
        self.stop()
        if _hostile_lab_handler is not None:
            _hostile_lab_handler(reason)

    def _follow(self, found: list[str]) -> None:
        """Keep standby connections at the endpoints the scheduler named (checked: :func:`endpoints_refusal`),
        and at it."""
        wanted = set(found) | {self.lab}
        for endpoint in wanted:
            self._keep(endpoint)
        for endpoint in set(self.keepers) - wanted:
            self.keepers.pop(endpoint).cancel()

    async def _keep_standby(self, endpoint: str) -> None:
        """Keep ``goblin.link.standby`` connections parked at ``endpoint``, and at most
        ``goblin.link.volunteer-connections`` open there for the lab to use (parked and activated): a lab
        activating each one at once gets no more until one closes."""
        from distributed.comm import connect

        slots = asyncio.Semaphore(max(1, int(settings.get("goblin.link.standby"))))
        room = asyncio.Semaphore(max(1, int(settings.get("goblin.link.volunteer-connections"))))
        wait = 0.2
        while True:
            await room.acquire()
            await slots.acquire()
            try:
                comm = await connect(endpoint, timeout=10, **self.dial)
                comm.limit = STANDBY_MESSAGE
                await comm.write({"op": rpc.STANDBY, "address": self.contact_address})
            except asyncio.CancelledError:
                raise
            except Exception as e:
                slots.release()
                room.release()
                logger.debug("standby connection to %s failed: %s; retrying in %.1f s", endpoint, e, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 30.0)
                continue
            task = asyncio.create_task(self._await_activation(comm, slots))
            self.serving.add(task)
            task.add_done_callback(self.serving.discard)
            task.add_done_callback(lambda _: room.release())
            wait = 0.2

    async def _await_activation(self, comm, slots: asyncio.Semaphore) -> None:
        self.standby.add(comm)
        opened = time.monotonic()
        try:
            msg = await comm.read()
        except (CommClosedError, OSError):
            msg = None
        finally:
            self.standby.discard(comm)
            if time.monotonic() - opened < 1.0:
                await asyncio.sleep(1.0)  # the lab closed it at once: do not hammer it
            slots.release()
        if msg != {"op": rpc.ACTIVATE}:
            if msg is not None:
                REFUSAL_LOG.failed(comm.peer_address, f"{str(msg)[:100]} on a standby connection (not an activation)")
            comm.abort()
            return
        comm.limit = max_message()
        try:  # distributed's handshake, this end answering; a lab that never sends its half loses the connection
            await asyncio.wait_for(self.on_connection(comm), float(settings.get("goblin.link.handshake-timeout")))
        except asyncio.TimeoutError:
            REFUSAL_LOG.failed(comm.peer_address, "an activation whose handshake did not come within "
                                                  "goblin.link.handshake-timeout")
            comm.abort()
            return
        except (CommClosedError, OSError):
            comm.abort()
            return
        await self.comm_handler(comm)  # distributed serves it in a task of its own ...
        await comm.gone.wait()  # ... and it counts among this lab process's connections until it closes


def install_volunteer_side() -> None:
    """Make this process a volunteer: the ``nat`` listener (no socket), and dials to ``tls://`` addresses on the
    lab's host only (:func:`dial_refusal`), every other scheme refused, messages read within bounds."""
    backends["nat"] = VolunteerNatBackend()
    backends["tls"] = VolunteerTLSBackend()
    for scheme in REFUSED_SCHEMES:
        backends[scheme] = RefusedBackend(scheme)
