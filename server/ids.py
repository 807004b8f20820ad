"""Typed identifiers. NewType keeps a lease id from being passed as a reservation id."""
from typing import NewType

BlockKey = NewType("BlockKey", bytes)          # opaque chained digest, fixed length
NamespaceId = NewType("NamespaceId", bytes)    # 16-byte digest of a NamespaceDescriptor
SessionId = NewType("SessionId", str)
LeaseId = NewType("LeaseId", int)
ReservationId = NewType("ReservationId", int)
TierName = NewType("TierName", str)            # "gpu", "host", "disk"

HOST = TierName("host")
DISK = TierName("disk")
GPU = TierName("gpu")
