"""Exceptions raised by redis-locks-async.

The tree::

    LockError(Exception)                  every failure of this library, with ``.name``
    ├── LockTimeout(LockError, TimeoutError)   the wait for a lock ran out of time
    └── LockNotOwnedError(LockError)           release/extend by a task that does not hold it
        └── LockLostError(LockNotOwnedError)   the lease expired or was taken over while held

Errors from redis-py (connection failures, server errors) are re-raised as :class:`LockError`
with the original exception chained (``raise ... from exc``), so ``except LockError`` catches
every failure of a lock operation while ``__cause__`` keeps the detail. Bad arguments are not
lock failures: they raise ``ValueError``/``TypeError`` at the call, before any I/O.
"""

from __future__ import annotations

__all__ = ("LockError", "LockLostError", "LockNotOwnedError", "LockTimeout")


class LockError(Exception):
    """Root of every error raised by a lock operation.

    ``name`` is the lock's name (``None`` when the error is not about one lock).
    """

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockTimeout(LockError, TimeoutError):
    """The lock could not be acquired before the timeout passed."""


class LockNotOwnedError(LockError):
    """The calling task does not hold the lock it tried to release or extend."""


class LockLostError(LockNotOwnedError):
    """The lease ended (expired, or another owner took the lock) while it was held.

    Work done under the lock after this point was not protected; the fencing token lets the
    protected resource reject such writes.
    """


def describe(exc: object) -> str:
    """``exc`` for a message or a log line, with its text: ``ConnectionError('max number of
    clients reached')``. Not ``repr(exc)``: redis-py 8's errors print as
    ``network:ConnectionError``, without what went wrong. (``None``: a connection lost
    without an error.)"""
    return BaseException.__repr__(exc) if isinstance(exc, BaseException) else repr(exc)
