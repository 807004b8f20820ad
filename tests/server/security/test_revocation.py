"""plan_revocations: which sessions a new tokens file no longer allows."""
from __future__ import annotations

from kvkeeper.server.ids import HOST, LOCAL, Identity
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.security.identity import SOCKET, TCP, for_token
from kvkeeper.server.security.revocation import (AUTH_TURNED_ON, MODEL_REMOVED, TOKEN_REMOVED,
                                                 TOKEN_ROTATED, log_revocations,
                                                 plan_revocations)
from kvkeeper.server.security.tokens import parse_tokens


def table(**models: list[str]):
    return parse_tokens({"tokens": {name: {"token": f"{name}-0123456789abcdef", "models": m}
                                    for name, m in models.items()}})


def test_the_plan_names_sessions_whose_token_went_or_no_longer_covers_them(caplog) -> None:
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 800, 100)]))
    reg = {}
    for name, owner, model in (("a1", for_token("a"), "m1"), ("a2", for_token("a"), "m2"),
                               ("b1", for_token("b"), "m1"), ("c1", for_token("c"), "m1"),
                               ("s", SOCKET, "m1"), ("t", TCP, "m9"), ("l", LOCAL, "m9"),
                               ("x", Identity("mtls:CN=x"), "m9")):
        reg[name] = led.register_session(
            name, NamespaceDescriptor(model_id=model, block_tokens=4, block_bytes=100), 0.0,
            owner=owner).id
    # a keeps m2 only; b keeps every model; c is gone.
    plan = plan_revocations(led.sessions.values(), table(a=["m2"], b=["*"]))
    got = {(r.session, r.holder, r.model, r.why) for r in plan}
    assert got == {(reg["a1"], "token a", "m1", MODEL_REMOVED),
                   (reg["c1"], "token c", "m1", TOKEN_REMOVED)}
    # Planning changes nothing; the same table again plans the same.
    assert len(led.sessions) == 8
    assert plan_revocations(led.sessions.values(), table(a=["m2"], b=["*"])) == plan
    with caplog.at_level("WARNING", logger="kvkeeper.auth"):
        ids = log_revocations(plan)
    assert set(ids) == {reg["a1"], reg["c1"]}
    assert "no longer covers" in caplog.text and "-0123456789abcdef" not in caplog.text
    # A table that covers everyone plans nothing.
    assert plan_revocations(led.sessions.values(), table(a=["*"], b=["*"], c=["m1"])) == []


def sessions_of(owners):
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 800, 100)]))
    return led, {str(o): led.register_session(
        "x", NamespaceDescriptor(model_id="m", block_tokens=4, block_bytes=100), 0.0,
        owner=o).id for o in owners}


def test_a_rotated_secret_ends_the_sessions_of_the_old_one() -> None:
    led, reg = sessions_of([for_token("a"), for_token("b")])
    old = table(a=["*"], b=["*"])
    rotated = parse_tokens({"tokens": {
        "a": {"token": "a-rotated-0123456789abcdef", "models": ["*"]},
        "b": {"token": "b-0123456789abcdef", "models": ["*"]}}})
    plan = plan_revocations(led.sessions.values(), rotated, old)
    assert [(r.session, r.why) for r in plan] == [(reg["token:a"], TOKEN_ROTATED)]
    assert plan_revocations(led.sessions.values(), old, old) == []


def test_defining_the_first_token_ends_the_sessions_that_came_in_without_one() -> None:
    led, reg = sessions_of([TCP, Identity("mtls:CN=x"), SOCKET, for_token("a")])
    none = parse_tokens({"quotas": {"*": "1GiB"}})
    plan = plan_revocations(led.sessions.values(), table(a=["*"]), none)
    assert {(r.session, r.why) for r in plan} == {(reg["tcp"], AUTH_TURNED_ON),
                                                  (reg["mtls:CN=x"], AUTH_TURNED_ON)}
    # Tokens before and after: TCP sessions could not exist; none planned by kind.
    assert plan_revocations(led.sessions.values(), table(a=["*"]), table(a=["*"])) == []
