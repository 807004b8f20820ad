"""The operator commands: `kvkeeper ls | inspect | evict | drain | verify`.

Each calls one RPC of kvkeeper.v1.KVKeeperAdmin and prints a table (or JSON
with --json). Exit status: 0 done; 1 the daemon could not do it (unreachable,
refused, unknown namespace or block; `verify` also when it found bad blocks);
2 a usage error.

    kvkeeper ls       [--url URL] [--json]
    kvkeeper inspect  NS_HEX KEY_HEX [--url URL] [--json]
    kvkeeper evict    (--namespace NS_HEX | --all) [--url URL] [--json]
    kvkeeper drain    [--url URL] [--json]
    kvkeeper verify   [--url URL] [--json]      (progress on stderr)

All take --timeout and the credentials of channel.py (--token-file, --tls...).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import grpc

from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc
from kvkeeper.v1 import kvkeeper_pb2 as pb

from .channel import Target, UsageError, add_connection_args, call_daemon
from .format import err, fmt_bytes, print_json, table, tier_name

NAMESPACE_HEX = 32


def add_commands(sub: Any) -> None:
    """Register the commands on the `kvkeeper` subparsers."""
    p = sub.add_parser("ls", help="list namespaces: model, layout, blocks and bytes per tier")
    add_connection_args(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show one block: tiers, state, refs, hits, idle time")
    p.add_argument("namespace", metavar="NS_HEX", help="namespace id (32 hex digits, see ls)")
    p.add_argument("key", metavar="KEY_HEX", help="block key in hex")
    add_connection_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("evict", help="drop unreferenced blocks from the host tier")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="NS_HEX", help="only this namespace")
    which.add_argument("--all", action="store_true", help="every namespace")
    add_connection_args(p)
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("drain", help="refuse new saves, flush the disk tier's write-back")
    add_connection_args(p)
    p.set_defaults(func=cmd_drain, timeout=None)

    p = sub.add_parser("verify", help="re-check every disk-tier checksum, quarantine bad files "
                                      "(`verify replay --help`: restart-and-replay check of vLLM)")
    add_connection_args(p)
    p.set_defaults(func=cmd_verify, timeout=None)


# --------------------------------------------------------------------------- plumbing
def _hex(text: str, what: str, nbytes: Optional[int] = None) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not hex") from None
    if nbytes is not None and len(raw) != nbytes:
        raise UsageError(f"{what} has {2 * nbytes} hex digits, got {len(text)}")
    return raw


def _call(args: argparse.Namespace, rpc: Callable[[Any, Optional[float]], Any],
          show: Callable[[Any, Target], int]) -> int:
    """Run rpc(stub, timeout) against --url and hand the answer to show()."""
    return call_daemon(args, lambda channel, timeout: rpc(
        admin_pb2_grpc.KVKeeperAdminStub(channel), timeout), show, _rpc_failure)


def _rpc_failure(e: Any, target: Target) -> str:
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and \
            not (e.details() or "").startswith("the daemon is shutting down"):
        return (f"cannot reach the daemon at {target.where}: {code.name}: {e.details()}; "
                "is `kvkeeper serve` running?")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"the daemon at {target.where} does not serve the admin API "
                "([admin] enabled = false in its configuration)")
    return f"{code.name}: {e.details()}"


# --------------------------------------------------------------------------- ls
def namespaces_json(resp: Any) -> list[dict[str, Any]]:
    out = []
    for n in resp.namespaces:
        d = n.descriptor
        out.append({
            "namespace_id": n.namespace_id.hex(), "registered": n.registered,
            "model_id": d.model_id, "model_revision": d.model_revision, "dtype": d.dtype,
            "kv_layout": d.kv_layout, "block_tokens": d.block_tokens,
            "block_bytes": d.block_bytes, "tp_rank": d.tp_rank, "tp_size": d.tp_size,
            "lora_tag": d.lora_tag, "cache_salted": bool(d.cache_salt),
            "sessions": n.sessions,
            "tiers": [{"tier": tier_name(t.tier), "blocks": t.blocks, "bytes": t.bytes}
                      for t in n.tiers],
            "quota_bytes": n.quota_bytes if n.HasField("quota_bytes") else None,
        })
    return out


def render_namespaces(items: list[dict[str, Any]]) -> str:
    if not items:
        return "no namespaces (no session registered since the daemon started)\n"
    tiers = sorted({t["tier"] for n in items for t in n["tiers"]},
                   key=lambda t: ("host", "disk").index(t) if t in ("host", "disk") else 9)
    head = ("namespace", "model", "dtype", "block", "tp", "sessions", *tiers, "quota")
    rows = [head]
    for n in items:
        by_tier = {t["tier"]: t for t in n["tiers"]}
        model = n["model_id"] or "(on disk only)"
        if n["model_revision"]:
            model += f"@{n['model_revision']}"
        if n["lora_tag"]:
            model += f" +{n['lora_tag']}"
        block = (f"{n['block_tokens']} tok, {fmt_bytes(n['block_bytes'])}" if n["registered"]
                 else "-")
        tp = f"{n['tp_rank']}/{n['tp_size']}" if n["registered"] else "-"
        cells = [f"{by_tier[t]['blocks']} ({fmt_bytes(by_tier[t]['bytes'])})" if t in by_tier
                 else "-" for t in tiers]
        quota = "-" if n["quota_bytes"] is None else fmt_bytes(n["quota_bytes"])
        rows.append((n["namespace_id"], model, n["dtype"] or "-", block, tp,
                     str(n["sessions"]), *cells, quota))
    return table(rows)


def cmd_ls(args: argparse.Namespace) -> int:

    def show(resp: Any, target: Target) -> int:
        items = namespaces_json(resp)
        if args.json:
            print_json(items)
        else:
            sys.stdout.write(render_namespaces(items))
        return 0

    return _call(args, lambda stub, t: stub.ListNamespaces(apb.ListNamespacesRequest(),
                                                           timeout=t), show)


# --------------------------------------------------------------------------- inspect
def block_json(resp: Any, ns: str, key: str) -> dict[str, Any]:
    return {
        "namespace_id": ns, "key": key,
        "copies": [{"tier": tier_name(c.tier), "state": c.state, "refs": c.refs, "hits": c.hits,
                    "idle_seconds": None if c.idle_seconds < 0 else c.idle_seconds,
                    "bytes": c.bytes} for c in resp.copies],
        "checksum_algo": pb.ChecksumAlgo.Name(resp.checksum_algo),
        "checksum": resp.checksum,
    }


def render_block(d: dict[str, Any]) -> str:
    rows = [("tier", "state", "refs", "hits", "idle", "bytes")]
    for c in d["copies"]:
        idle = "-" if c["idle_seconds"] is None else f"{c['idle_seconds']:.1f}s"
        rows.append((c["tier"], c["state"], str(c["refs"]),
                     str(c["hits"]) if c["tier"] != "disk" else "-", idle, str(c["bytes"])))
    text = f"block {d['key']}\n  in namespace {d['namespace_id']}\n"
    text += "".join("  " + line + "\n" for line in table(rows).splitlines())
    if d["checksum_algo"] != "CHECKSUM_NONE":
        text += f"  checksum {d['checksum_algo'][len('CHECKSUM_'):].lower()} {d['checksum']:#x}\n"
    return text


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        ns = _hex(args.namespace, "NS_HEX", NAMESPACE_HEX // 2)
        key = _hex(args.key, "KEY_HEX")
    except UsageError as e:
        err(str(e))
        return 2

    def show(resp: Any, target: Target) -> int:
        d = block_json(resp, ns.hex(), key.hex())
        if args.json:
            print_json(d)
        else:
            sys.stdout.write(render_block(d))
        return 0

    return _call(args, lambda stub, t: stub.InspectBlock(
        apb.InspectBlockRequest(namespace_id=ns, key=key), timeout=t), show)


# --------------------------------------------------------------------------- evict
def cmd_evict(args: argparse.Namespace) -> int:
    if args.all:
        req = apb.EvictRequest(all=True)
    else:
        try:
            req = apb.EvictRequest(namespace_id=_hex(args.namespace, "--namespace",
                                                     NAMESPACE_HEX // 2))
        except UsageError as e:
            err(str(e))
            return 2

    def show(resp: Any, target: Target) -> int:
        if args.json:
            print_json({"evicted": resp.evicted, "remaining": resp.remaining})
        else:
            scope = "every namespace" if args.all else f"namespace {args.namespace.lower()}"
            print(f"evicted {resp.evicted} blocks from the host tier of {scope}; "
                  f"{resp.remaining} stay (referenced by a lease or being written)")
        return 0

    return _call(args, lambda stub, t: stub.Evict(req, timeout=t), show)


# --------------------------------------------------------------------------- drain
def cmd_drain(args: argparse.Namespace) -> int:

    def show(resp: Any, target: Target) -> int:
        if args.json:
            print_json({"draining": True, "disk_tier": resp.disk_tier,
                         "open_reservations": resp.open_reservations, "seconds": resp.seconds})
        else:
            flushed = (f"write-back flushed to the disk tier in {resp.seconds:.2f}s"
                       if resp.disk_tier else "no disk tier to flush")
            print(f"draining: {target.url} refuses new saves until it restarts; {flushed}; "
                  f"{resp.open_reservations} saves reserved before the drain are still open")
        return 0

    return _call(args, lambda stub, t: stub.Drain(apb.DrainRequest(), timeout=t), show)


# --------------------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    tty = sys.stderr.isatty()

    def run(stub: Any, timeout: Optional[float]) -> Any:
        final = None
        for msg in stub.Verify(apb.VerifyRequest(), timeout=timeout):
            if msg.done:
                final = msg
                break
            end = "\r" if tty else "\n"
            print(f"verify: {msg.processed}/{msg.total} blocks", end=end, file=sys.stderr,
                  flush=True)
        if tty:
            print(file=sys.stderr)
        return final

    def show(final: Any, target: Target) -> int:
        if final is None:
            err("the daemon ended the verify without a result")
            return 1
        d = {"checked": final.checked, "bad": final.bad, "missing": final.missing,
             "quarantined": final.quarantined, "bytes": final.bytes, "seconds": final.seconds}
        if args.json:
            print_json(d)
        else:
            print(f"verified {final.total} blocks in {final.seconds:.1f}s: {final.checked} good "
                  f"({fmt_bytes(final.bytes)}), {final.bad} bad ({final.quarantined} moved to "
                  f"quarantine/), {final.missing} gone meanwhile")
        return 1 if final.bad else 0

    return _call(args, run, show)
