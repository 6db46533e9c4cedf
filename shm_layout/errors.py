"""The root of every error gateway-capacity raises on purpose, and every error a handler meets.

Imports nothing of ours, so everything can stand on it: the admission core
(``_core.c`` raises :class:`CoreError` and :class:`DamagedLock` from here), the
segment, the config, admission. The modules that raise them re-export their own
under the old names (``shm_layout.segment.SegmentError``, ``gateway_config.ConfigError``,
``handler_shim.admission.QueueFull`` ...), and ``handler_shim`` exports the whole tree.
``str()`` of every one is one line that says what to fix. The tree, drawn here only
(``tests/admission/test_exception_tree.py`` checks the drawing against the classes)::

    GatewayCapacityError               anything gateway-capacity refused
    ├── BadSegmentName (ValueError)    attach: the segment name cannot be used
    ├── OwnerError (ValueError)        attach(owner=..., group=...): no such user or group
    ├── ForeignObject                  attach: the lock file or its directory is not ours
    ├── NotOnThisPlatform              a call this platform does not have
    ├── ConfigError                    attach(config=...): the file cannot be read or parsed
    ├── ProviderIdError (ValueError)   a provider id the segment cannot store
    ├── TableFull                      the segment has no row left for another provider
    ├── CoreError (OSError)            the admission core refused a call (a stale ticket)
    │   └── DamagedLock                the segment's lock word holds what no lock writes
    ├── SegmentError                   attach: the shared segment cannot be used
    │   ├── SegmentMissing
    │   ├── SegmentNotReady            its creator never finished initialising it
    │   ├── UnsafePermissions
    │   ├── IncompatibleLayout         another major layout version (R-G2)
    │   └── NotOurSegment
    │       ├── ForeignSegment         another user owns it: --group-shared and owner=
    │       └── DamagedSegment         ours by its header, values no writer produces
    └── AdmissionError                 attach: no member row left; use after close()
        ├── QueueFull                  the provider's queue is at its bound (R-A2)
        ├── RequestTooLarge (ValueError)  more tokens than any worker can hold (R-T2)
        ├── AdmissionTimeout (TimeoutError)  no slot within the timeout (R-A4)
        └── UnknownProvider (KeyError) not in the segment, or no row for it (R-A13)

The sidecar's and the router's own errors also derive from the root but stay beside
what raises them, since no handler meets them: ``StartupError`` and ``UntrustedPidfile``
(``sidecar.startup``, ``sidecar.legacy``: how the daemon exits 2), ``ContractError``
(``capacity_contract``: an answer that is not the capacity contract), ``CredentialError``
(``sidecar.credential``: a key file that cannot be used), ``ShareUnavailable``
(``sidecar.share``: Redis did not answer), ``RegistryError`` and ``Unreadable``
(``capacity_router``: the worker registry, a worker's slot count).
``tests/repo/test_layering.py`` holds every public exception class of ours under the
root. Private control-flow exceptions (``_Abandoned``, ``Superseded``,
``Refusal`` ...) stay private in the modules that raise and catch them.
"""

from __future__ import annotations


class GatewayCapacityError(Exception):
    """Base of the errors gateway-capacity raises on purpose; ``str()`` says what to fix."""


class BadSegmentName(GatewayCapacityError, ValueError):
    """A segment name that cannot be used on every supported OS."""


class OwnerError(GatewayCapacityError, ValueError):
    """An owner or group setting that names no user or group."""


class ForeignObject(GatewayCapacityError):
    """An object under one of our names that belongs to someone we do not trust."""


class NotOnThisPlatform(GatewayCapacityError):
    """A call the platform (or the darwin test mode) does not have."""


class ConfigError(GatewayCapacityError):
    """The file as a whole cannot be used. ``str()`` is one line naming the file."""


class ProviderIdError(GatewayCapacityError, ValueError):
    """A provider id that cannot be stored in the segment without losing part of it."""


class TableFull(GatewayCapacityError):
    """Every provider row of the segment is taken (R-A13)."""


class CoreError(GatewayCapacityError, OSError):
    """The core could not do a step; str() says what to fix."""


class DamagedLock(CoreError):
    """The segment's lock word holds bytes no lock call of ours wrote."""


class SegmentError(GatewayCapacityError):
    """Base of every segment problem; ``str()`` is one line saying what to do."""


class SegmentMissing(SegmentError):
    pass


class NotOurSegment(SegmentError):
    pass


class ForeignSegment(NotOurSegment):
    """An object under our name owned by a user (or group) this process does not trust."""


class IncompatibleLayout(SegmentError):
    """The segment speaks another major layout version (R-G2)."""

    def __init__(self, name: str, found: tuple[int, int]) -> None:
        from shm_layout.layout import MAJOR, MINOR

        self.found = found
        super().__init__(
            f"segment {name} has layout {found[0]}.{found[1]}, this program speaks "
            f"{MAJOR}.{MINOR}: not compatible (different major version). Stop the other "
            f"generation, or once nothing uses it remove the segment with 'gateway-capacity "
            f"inspect --segment {name} --unlink --force'."
        )


class SegmentNotReady(SegmentError):
    pass


class UnsafePermissions(SegmentError):
    pass


class DamagedSegment(NotOurSegment):
    """Ours by its header, but its tables hold values no writer of ours produces."""


class AdmissionError(GatewayCapacityError):
    """Base of the errors of admitting a request (the segment's are :class:`SegmentError`).

    Besides ``str()``, the context is in attributes, None where it does not apply or
    could not be read: ``provider`` (its id), ``limit`` (the limit in force), ``running``
    (its slots in use), ``waiting`` (requests queued for it, a timed-out one included),
    ``timeout`` (seconds)."""

    def __init__(
        self,
        *args: object,
        provider: str | None = None,
        limit: int | None = None,
        running: int | None = None,
        waiting: int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(*args)
        self.provider = provider
        self.limit = limit
        self.running = running
        self.waiting = waiting
        self.timeout = timeout


class QueueFull(AdmissionError):
    """The provider's queue already holds its bound of waiters (R-A2)."""


class RequestTooLarge(AdmissionError, ValueError):
    """A request charged more tokens than any worker of its provider can hold: above the
    most one request may hold, or the whole token budget (R-T2). Refused at once, never
    queued. Besides :class:`AdmissionError`'s attributes: ``tokens`` (its charge),
    ``request_token_limit`` and ``token_limit`` (as published; None unknown)."""

    def __init__(
        self,
        *args: object,
        tokens: int = 0,
        request_token_limit: int | None = None,
        token_limit: int | None = None,
        provider: str | None = None,
    ) -> None:
        super().__init__(*args, provider=provider)
        self.tokens = tokens
        self.request_token_limit = request_token_limit
        self.token_limit = token_limit


class AdmissionTimeout(AdmissionError, TimeoutError):
    """No slot was granted within the timeout; nothing is left queued (R-A4)."""


class UnknownProvider(AdmissionError, KeyError):
    """A provider the segment does not have, or has no row for (R-A13)."""

    def __str__(self) -> str:
        return str(self.args[0])
