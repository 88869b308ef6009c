"""The exception tree of Spotlight.

Recoverable errors (a request can be retried elsewhere, a run goes on) derive from
``Recoverable``; fatal ones (a peer is gone for good, a protocol was broken, a config is wrong)
derive from ``Fatal``. Code catches the narrowest class it can act on and never swallows others.
"""

from __future__ import annotations


class SpotlightError(Exception):
    """Root of every error Spotlight raises on purpose."""


# --- recoverable -------------------------------------------------------------------------------
class Recoverable(SpotlightError):
    """The operation failed, but retrying it (possibly elsewhere) is sound."""


class Preempted(Recoverable):
    """This worker or node received a spot notice and is leaving."""


class GroupBroken(Recoverable):
    """A sequence-parallel group lost a member or a collective failed (a dead or hung peer): the
    request resumes from its last commit on a new group."""


class Cancelled(Recoverable):
    """The lease of a running request was revoked (its batch cancelled): the work was dropped
    between two denoising steps; nothing is retried."""


class LeaseExpired(Recoverable):
    """A lease was not renewed in time; the request went back to the queue."""


class ActorTimeout(Recoverable):
    """A remote actor did not answer within the request's timeout."""


class StaleAttempt(Recoverable):
    """A result came from an attempt that is no longer current (fenced off)."""


# --- fatal ----------------------------------------------------------------------------------------
class Fatal(SpotlightError):
    """Retrying cannot help."""


class ActorDead(Fatal):
    """The remote actor's process is gone."""


class ProtocolError(Fatal):
    """A frame or message broke the wire protocol (malformed, oversized, wrong type)."""


class ConfigError(Fatal, ValueError):
    """A recipe or config field is unknown or out of range; the message names the field."""


class TraceError(ConfigError):
    """A spot trace file is malformed; the message names the file, the line and what was expected."""


class CapacityError(Fatal):
    """A bounded resource (e.g. the tensor store's memory cap) would be exceeded."""


class NotFound(Fatal, KeyError):
    """A key, weights version, checkpoint or model folder does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class RemoteError(Fatal):
    """The remote actor failed while handling a request (a bug on its side, not ours)."""
