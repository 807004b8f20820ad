"""Which sessions a new tokens file takes away: a plan, made before a reload applies it.

A session belongs to the identity that registered it (identity.py); a token's
identity is its name. Each call checks the token itself, but not the model of
the session it names. So when a reload removes a token, or narrows it to
models that no longer include a session's, that session is ended ("revoked":
its leases and reservations are released at once). Otherwise revoking a
tenant's access would take effect only when its engines next register.
Sessions of other identities (the unix socket, plain TCP, a client
certificate) do not depend on the tokens file and are never in the plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from ..ids import SessionId
from ..ledger.records import Session
from ..ledger.sessions import tag
from ..quoting import clip
from .identity import TOKEN_PREFIX
from .tokens import TokenTable

__all__ = ["Revocation", "log_revocations", "plan_revocations"]

log = logging.getLogger("kvkeeper.auth")

TOKEN_REMOVED = "the token was removed"
MODEL_REMOVED = "the token no longer covers the model"


@dataclass(frozen=True)
class Revocation:
    session: SessionId
    token: str     # the token's name
    model: str
    why: str       # TOKEN_REMOVED or MODEL_REMOVED


def plan_revocations(sessions: Iterable[Session], table: TokenTable) -> list[Revocation]:
    """The sessions that `table`, about to be put in force, no longer allows."""
    grants = {g.name: g for g in table.grants}
    plan = []
    for s in sessions:
        if not s.owner.startswith(TOKEN_PREFIX):
            continue
        name, model = s.owner[len(TOKEN_PREFIX):], s.ns.descriptor.model_id
        grant = grants.get(name)
        if grant is None:
            plan.append(Revocation(s.id, name, model, TOKEN_REMOVED))
        elif not grant.allows_model(model):
            plan.append(Revocation(s.id, name, model, MODEL_REMOVED))
    return plan


def log_revocations(plan: Iterable[Revocation]) -> list[SessionId]:
    """One WARNING line per session the plan ends; their ids, for Ledger.revoke."""
    ids = []
    for r in plan:
        log.warning("reload: session %s of token %s ended: %s (model %s)", tag(r.session),
                    r.token, r.why, clip(r.model),
                    extra={"event": "session_revoked", "token": r.token, "why": r.why})
        ids.append(r.session)
    return ids
