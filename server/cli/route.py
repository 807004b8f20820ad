"""`kvkeeper route --tokens FILE`: where a prompt's prefix is, per engine and tier.

The keys come from kvkeeper.client.route.keys_for_tokens (the connector's own
key code) over the namespace the engines registered: given with --namespace
(a JSON object of descriptor fields, or a file holding one), or else the
daemon's one registered namespace (admin ListNamespaces; --namespace-id or
--model pick one of several). The answer is the daemon's Locate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import grpc

from kvkeeper.client.route import Router, keys_for_tokens
from kvkeeper.client.keys import NAMESPACE_FIELDS
from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc as apb_grpc

from .channel import Target, UsageError, add_connection_args, call_daemon
from .format import err, print_json, table, tier_name

SALT_SET = "(set)"


def add_command(sub: Any) -> None:
    p = sub.add_parser("route", help="where a prompt's prefix is: per engine's GPU cache, "
                                     "host and disk (Locate)")
    add_connection_args(p)
    p.add_argument("--tokens", required=True, metavar="FILE",
                   help="the prompt's token ids: a JSON list, or integers separated by "
                        "whitespace or commas ('-': stdin)")
    p.add_argument("--namespace", metavar="JSON|FILE",
                   help="the engines' namespace descriptor (fields: "
                        f"{', '.join(NAMESPACE_FIELDS)}); default: the daemon's registered one")
    p.add_argument("--namespace-id", metavar="HEX", help="pick this registered namespace "
                   "(a prefix of its id, as `kvkeeper ls` shows)")
    p.add_argument("--model", help="pick the registered namespace of this model id")
    p.add_argument("--cache-salt", help="the request's cache salt, if any")
    p.add_argument("--lora", help="the request's LoRA tag, if any")
    p.set_defaults(func=cmd_route)


def read_tokens(path: str) -> list[int]:
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as e:
        raise UsageError(f"--tokens {path}: {e.strerror or e}") from None
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
        tokens = [int(v) for v in values]
    except (ValueError, TypeError):
        raise UsageError(f"--tokens {path}: not a JSON list of integers nor integers "
                         "separated by whitespace") from None
    if any(t < 0 for t in tokens):
        raise UsageError(f"--tokens {path}: token ids are not negative")
    return tokens


def parse_namespace(text: str) -> dict[str, Any]:
    if not text.lstrip().startswith("{") and os.path.exists(text):
        with open(text, encoding="utf-8") as fh:
            text = fh.read()
    try:
        ns = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--namespace: not JSON: {e}") from None
    if not isinstance(ns, dict) or set(ns) - set(NAMESPACE_FIELDS):
        raise UsageError(f"--namespace: an object of the fields {', '.join(NAMESPACE_FIELDS)}")
    return ns


def pick_namespace(resp: Any, ns_id: Optional[str], model: Optional[str]) -> dict[str, Any]:
    """The descriptor of the one registered namespace the filters leave."""
    found = []
    for info in resp.namespaces:
        if not info.registered:
            continue
        if ns_id and not info.namespace_id.hex().startswith(ns_id.lower()):
            continue
        if model and info.descriptor.model_id != model:
            continue
        found.append(info)
    if len(found) != 1:
        names = ", ".join(f"{i.namespace_id.hex()[:12]} ({i.descriptor.model_id} tp "
                          f"{i.descriptor.tp_rank}/{i.descriptor.tp_size})" for i in found)
        raise UsageError(f"{len(found)} registered namespaces match ({names or 'none'}); "
                         "pick one with --namespace-id or --model, or give --namespace")
    d = found[0].descriptor
    if d.cache_salt == SALT_SET:
        raise UsageError("that namespace has a cache salt the daemon does not show; "
                         "give its descriptor with --namespace")
    return {f: getattr(d, f) for f in NAMESPACE_FIELDS}


def route_dict(resp: Any, asked: int, block_tokens: int) -> dict[str, Any]:
    return {
        "namespace_id": resp.namespace_id.hex(), "keys": asked, "block_tokens": block_tokens,
        "stored": resp.stored,
        "engines": [{"engine": e.engine, "instance_id": e.instance_id, "prefix": e.prefix,
                     "resident_blocks": e.resident_blocks, "capacity_blocks": e.capacity_blocks}
                    for e in resp.engines],
        "tiers": [{"tier": tier_name(t.tier), "prefix": t.prefix} for t in resp.tiers],
    }


def render_route(d: dict[str, Any]) -> str:
    bt = d["block_tokens"]
    rows = [("where", "prefix blocks", "tokens", "resident", "instance")]
    for e in d["engines"]:
        rows.append((f"gpu {e['engine']}", str(e["prefix"]), str(e["prefix"] * bt),
                     f"{e['resident_blocks']}/{e['capacity_blocks']}", e["instance_id"]))
    for t in d["tiers"]:
        rows.append((t["tier"], str(t["prefix"]), str(t["prefix"] * bt), "", ""))
    rows.append(("daemon (any tier)", str(d["stored"]), str(d["stored"] * bt), "", ""))
    head = (f"namespace {d['namespace_id'][:12]}: {d['keys']} full blocks of {bt} tokens "
            f"asked; {len(d['engines'])} engines report\n")
    return head + table(rows, right=frozenset({1, 2, 3}))


def cmd_route(args: argparse.Namespace) -> int:
    def ask(channel: grpc.Channel, timeout: Optional[float]) -> tuple[Any, int, int]:
        if args.namespace:
            ns = parse_namespace(args.namespace)
        else:
            listing = apb_grpc.KVKeeperAdminStub(channel).ListNamespaces(
                apb.ListNamespacesRequest(), timeout=timeout)
            ns = pick_namespace(listing, args.namespace_id, args.model)
        try:
            keys = keys_for_tokens(ns, tokens, cache_salt=args.cache_salt, lora=args.lora)
        except ValueError as e:
            raise UsageError(f"--namespace: {e}") from None
        resp = Router(channel, timeout=timeout or 5.0).locate(ns, keys)
        return resp, len(keys), int(ns.get("block_tokens") or 0)

    def show(answer: tuple[Any, int, int], target: Target) -> int:
        d = route_dict(*answer)
        if args.json:
            print_json(d)
        else:
            sys.stdout.write(render_route(d))
        return 0

    def failure(e: grpc.RpcError, target: Target) -> str:
        hint = ("; its admin service is off, so name the namespace with --namespace"
                if e.code() == grpc.StatusCode.UNIMPLEMENTED and not args.namespace else "")
        return f"the daemon at {target.where} failed: {e.code().name}: {e.details()}{hint}"

    try:
        tokens = read_tokens(args.tokens)
        return call_daemon(args, ask, show, failure)
    except UsageError as e:   # a namespace that cannot be picked, or no keys can be made of
        err(str(e))
        return e.exit_code
