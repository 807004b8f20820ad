"""Typed identifiers. NewType keeps a lease id from being passed as a reservation id."""
from typing import NewType

BlockKey = NewType("BlockKey", bytes)          # opaque chained digest, fixed length
NamespaceId = NewType("NamespaceId", bytes)    # 16-byte digest of a NamespaceDescriptor
SessionId = NewType("SessionId", str)
LeaseId = NewType("LeaseId", int)
ReservationId = NewType("ReservationId", int)
TierName = NewType("TierName", str)            # "gpu", "host", "disk", "cluster"
# A reporting engine's public name: its session's non-secret tag ("s1a"), never the id.
EngineId = NewType("EngineId", str)
# Who registered a session: "token:<name>", "mtls:<subject>", "socket", "tcp", ...
Identity = NewType("Identity", str)

HOST = TierName("host")
DISK = TierName("disk")
GPU = TierName("gpu")
CLUSTER = TierName("cluster")

# In-process callers that name nobody (tests, benchmarks); no RPC is ever LOCAL.
LOCAL = Identity("local")
# The owner of the ledger's internal holder (the tier stack's flushes and promotions);
# no caller can be it.
INTERNAL = Identity("internal")
