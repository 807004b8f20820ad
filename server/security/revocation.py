"""Which sessions a new tokens file takes away: a plan, made before a reload applies it.

A session belongs to the identity that registered it (identity.py); a token's
identity is its name. Each call checks the token itself, but not the model of
the session it names. So when a reload removes a token, narrows it to models
that no longer include a session's, or changes its secret (a rotation: the
old secret's sessions must not outlive it), that session is ended
("revoked": its leases and reservations are released at once). Otherwise
revoking a tenant's access would take effect only when its engines next
register. Plain TCP and client-certificate callers without a token are let
in only while the file defines no token (auth.py): a reload that defines the
first one ends their sessions too. Unix socket sessions never depend on it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

from ..ids import SessionId
from ..ledger.records import Session
from ..ledger.sessions import tag
from ..quoting import clip
from .identity import MTLS_PREFIX, TCP, TOKEN_PREFIX
from .tokens import TokenTable

__all__ = ["Revocation", "log_revocations", "plan_revocations"]

log = logging.getLogger("kvkeeper.auth")

TOKEN_REMOVED = "the token was removed"
MODEL_REMOVED = "the token no longer covers the model"
TOKEN_ROTATED = "the token's secret was changed"
AUTH_TURNED_ON = "the tokens file now defines tokens, and this caller presented none"


@dataclass(frozen=True)
class Revocation:
    session: SessionId
    holder: str    # "token <name>", or the identity of a caller without a token
    model: str
    why: str       # TOKEN_REMOVED, MODEL_REMOVED, TOKEN_ROTATED or AUTH_TURNED_ON


def plan_revocations(sessions: Iterable[Session], table: TokenTable,
                     old: Optional[TokenTable] = None) -> list[Revocation]:
    """The sessions that `table`, about to replace `old`, no longer allows."""
    grants = {g.name: g for g in table.grants}
    digests = {g.name: g.digest for g in old.grants} if old is not None else {}
    turned_on = old is not None and not old.grants and bool(table.grants)
    plan = []
    for s in sessions:
        model = s.ns.descriptor.model_id
        if not s.owner.startswith(TOKEN_PREFIX):
            if turned_on and (s.owner == TCP or s.owner.startswith(MTLS_PREFIX)):
                plan.append(Revocation(s.id, clip(s.owner), model, AUTH_TURNED_ON))
            continue
        name = s.owner[len(TOKEN_PREFIX):]
        grant, holder = grants.get(name), f"token {name}"
        if grant is None:
            plan.append(Revocation(s.id, holder, model, TOKEN_REMOVED))
        elif not grant.allows_model(model):
            plan.append(Revocation(s.id, holder, model, MODEL_REMOVED))
        elif digests.get(name, grant.digest) != grant.digest:
            plan.append(Revocation(s.id, holder, model, TOKEN_ROTATED))
    return plan


def log_revocations(plan: Iterable[Revocation]) -> list[SessionId]:
    """One WARNING line per session the plan ends; their ids, for Ledger.revoke."""
    ids = []
    for r in plan:
        log.warning("reload: session %s of %s ended: %s (model %s)", tag(r.session),
                    r.holder, r.why, clip(r.model),
                    extra={"event": "session_revoked", "holder": r.holder, "why": r.why})
        ids.append(r.session)
    return ids
