"""redis-locks-async: asyncio-native distributed locks for Redis and Valkey."""

from ._core import LockState as LockState
from ._core import LockStatistics as LockStatistics
from ._errors import LockError as LockError
from ._errors import LockLostError as LockLostError
from ._errors import LockNotOwnedError as LockNotOwnedError
from ._errors import LockTimeout as LockTimeout
from ._fair import FairLock as FairLock
from ._lease import HoldState as HoldState
from ._lease import Lease as Lease
from ._lock import Lock as Lock
from ._redlock import RedLock as RedLock
from ._rwlock import ReadWriteLock as ReadWriteLock
from ._semaphore import Semaphore as Semaphore

__version__ = "0.1.0"

__all__ = (
    "FairLock",
    "HoldState",
    "Lease",
    "Lock",
    "LockError",
    "LockLostError",
    "LockNotOwnedError",
    "LockState",
    "LockStatistics",
    "LockTimeout",
    "ReadWriteLock",
    "RedLock",
    "Semaphore",
)
