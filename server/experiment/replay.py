"""`kvkeeper verify replay`: seed 003's check that reuse really came from kvkeeper.

    kvkeeper verify replay --backend-url URL --prompts FILE.jsonl
        [--restart-cmd CMD | --wait-seconds S] [--expect-hit-tokens full-blocks|any|N]
        [--max-tokens N] [--block-size B] [--daemon-metrics-url URL] [--out REPORT.json]

1. baseline: every prompt once, in file order, one at a time, greedy
   (temperature 0); outputs and vLLM's counters recorded;
2. restart: --restart-cmd, else the operator restarts the server (Enter on
   stdin, or --wait-seconds); then wait until /health or /v1/models answers.
   vLLM's own prefix cache is empty now, the daemon still holds the blocks;
3. replay: the same prompts the same way.

It passes only if all of these hold (each is named in the report):
  requests     every request of both phases succeeded;
  hit_tokens   vllm:kvkeeper_hit_tokens_total rose during the replay by at least
               the expected amount (--expect-hit-tokens):
               full-blocks (default): the sum over prompts of the tokens of its full
                 blocks, capped at prompt tokens - 1 (vLLM computes the last token
                 itself), less the leading full blocks an earlier prompt of the
                 file already put in vLLM's own cache (found from /tokenize's token
                 ids; without /tokenize prompts are taken to share no block);
                 block size from vllm:cache_config_info, else --block-size;
               any: more than zero;  N: at least N;
  load_errors  vllm:kvkeeper_load_errors_total, _load_error_blocks_total and
               _checksum_errors_total did not rise in either phase (and the
               daemon's kvkeeper_disk_checksum_failures_total, when scraped and
               exported: the daemon has it with a disk tier);
               a counter that is not exported fails this: it cannot be checked;
  outputs      every replay output equals its baseline output.
Exit status: 0 pass, 1 fail (or the server could not be used), 2 usage error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import metrics_text as mt
from .artifacts import environment, save_snapshot, write_json
from .lifecycle import RestartError, operator_restart, restart
from .openai_client import Backend, BackendError, RequestRecord
from .progress import Progress
from .workload import Row, read_jsonl, sha256_file

SCHEMA_VERSION = "kvkeeper-verify-replay/v1"
ERROR_COUNTERS = (mt.CONNECTOR_LOAD_ERRORS, mt.CONNECTOR_LOAD_ERROR_BLOCKS,
                  mt.CONNECTOR_CHECKSUM_ERRORS)
RECORDED = (mt.CONNECTOR_HIT_TOKENS, mt.VLLM_PREFIX_HITS, mt.VLLM_EXTERNAL_HITS, *ERROR_COUNTERS)
DAEMON_RECORDED = (mt.DAEMON_HIT_TOKENS, mt.DAEMON_HIT_BLOCKS, mt.DAEMON_DISK_CHECKSUM_FAILURES)
RESTART_MARK = "process_start_time_seconds"


def _rule(text: str) -> str:
    if text in ("full-blocks", "any") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"expected full-blocks, any or a positive integer, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkeeper verify replay", epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Send prompts, restart the server, replay them: pass "
                                            "only if kvkeeper served the replay, without load "
                                            "errors, with identical outputs.")
    p.add_argument("--backend-url", metavar="URL", required=True, help="the OpenAI-compatible server")
    p.add_argument("--prompts", required=True, type=Path, metavar="FILE",
                   help="JSONL, one {\"prompt\": ...} a line (the experiment's workloads fit)")
    p.add_argument("--model", metavar="NAME", help="model name (default: the server's first model)")
    p.add_argument("--max-tokens", metavar="N", type=int, default=None,
                   help="output tokens of every prompt (default: the file's, else 32)")
    p.add_argument("--restart-cmd", metavar="CMD", help="shell command restarting the server")
    p.add_argument("--wait-seconds", type=float, metavar="S",
                   help="without --restart-cmd: wait S seconds for the operator's restart "
                        "(default: wait for Enter on stdin)")
    p.add_argument("--restart-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the server after the restart (600)")
    p.add_argument("--expect-hit-tokens", type=_rule, default="full-blocks", metavar="RULE",
                   help="full-blocks (default), any, or a number of tokens")
    p.add_argument("--block-size", metavar="B", type=int, help="tokens per block (default: from vLLM's metrics)")
    p.add_argument("--metrics-url", metavar="URL", help="vLLM's metrics (default: BACKEND_URL/metrics)")
    p.add_argument("--daemon-metrics-url", metavar="URL", help="the kvkeeper daemon's metrics (recorded)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default $OPENAI_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--out", type=Path, metavar="REPORT.json",
                   help="write the JSON report (and the raw metrics beside it)")
    p.add_argument("--settle-seconds", type=float, default=0.5, metavar="S",
                   help="pause before each post-phase scrape, for the last steps' counters (0.5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def expected_hit_tokens(prompt_tokens: List[Optional[int]], token_ids: List[Optional[List[int]]],
                        block: int) -> Tuple[Optional[int], str]:
    """(the full-blocks rule's expectation or None when a prompt's length is unknown, basis)."""
    seen: set = set()
    total = 0
    shared_known = all(t is not None for t in token_ids)
    for n, ids in zip(prompt_tokens, token_ids):
        if n is None:
            return None, "a prompt's token count is unknown (no /tokenize, no usage)"
        full = n // block
        top = min(full * block, n - 1)
        local = 0
        if ids is not None:
            chain = [tuple(ids[:(k + 1) * block]) for k in range(full)]
            k = 0
            while k < full and chain[k] in seen:
                k += 1
            local = min(k * block, ((n - 1) // block) * block)
            seen.update(chain)
        total += max(0, top - local)
    basis = ("token ids from /tokenize" if shared_known
             else "prompt token counts; prompts assumed to share no block")
    return total, f"full-blocks, block size {block}, {basis}"


class Check:
    def __init__(self, args: argparse.Namespace, rows: List[Row]):
        self.args, self.rows = args, rows
        self.backend = Backend(args.backend_url, args.api_key, args.request_timeout)
        self.vllm_url = mt.metrics_url(args.metrics_url or self.backend.base_url)
        self.daemon_url = mt.metrics_url(args.daemon_metrics_url) \
            if args.daemon_metrics_url else None
        self.report: Dict[str, Any] = {"schema_version": SCHEMA_VERSION, "snapshots": {}}
        self.snaps: Dict[str, Dict[str, mt.Snapshot]] = {}

    def snapshot(self, name: str) -> Dict[str, mt.Snapshot]:
        s = {"vllm": mt.fetch(self.vllm_url), "daemon": mt.fetch(self.daemon_url)}
        self.snaps[name] = s
        return s

    def phase(self, name: str, model: str) -> List[RequestRecord]:
        bar = Progress(name, len(self.rows), enabled=not self.args.quiet)
        records, _ = self.backend.run(self.rows, model, 1, {"temperature": 0.0},
                                      on_done=lambda r: bar.step(r.ok))
        time.sleep(self.args.settle_seconds)
        return records

    def go(self) -> None:
        args, b, rep = self.args, self.backend, self.report
        model, served = b.connect(args.model)
        rep["environment"] = environment(b, self.daemon_url, served)
        rep["model"] = model
        pre = self.snapshot("baseline_pre")
        block = args.block_size
        source = "--block-size"
        if block is None:
            found = mt.label_value(pre["vllm"].text, "vllm:cache_config_info", "block_size")
            block = int(found) if found and found.isdigit() else None
            source = "vllm:cache_config_info" if block else "unknown"
        rep["block_size"] = {"tokens": block, "source": source}
        ids = [b.tokenize(model, r.prompt) for r in self.rows]
        base = self.phase("baseline", model)
        self.snapshot("baseline_post")
        rep["restart"] = restart(b, args.restart_cmd, args.restart_timeout, args.ready_timeout) \
            if args.restart_cmd else operator_restart(b, args.wait_seconds, args.ready_timeout)
        self.snapshot("replay_pre")
        again = self.phase("replay", model)
        self.snapshot("replay_post")
        counts = [len(t) if t is not None else r.prompt_tokens for t, r in zip(ids, base)]
        rep["prompts_detail"] = [
            {"id": row.id, "prompt_tokens": n, "baseline": a.to_json(), "replay": z.to_json()}
            for row, n, a, z in zip(self.rows, counts, base, again)]
        self.judge(base, again, counts, ids, block)

    def deltas(self, phase: str) -> Tuple[Dict[str, Any], Dict[str, str]]:
        pre, post = self.snaps[f"{phase}_pre"], self.snaps[f"{phase}_post"]
        v, why_v = mt.deltas(pre["vllm"], post["vllm"], RECORDED)
        d, why_d = mt.deltas(pre["daemon"], post["daemon"], DAEMON_RECORDED) \
            if self.daemon_url else ({}, {})
        return {**v, **d}, {**why_v, **why_d}

    def judge(self, base: List[RequestRecord], again: List[RequestRecord],
              counts: List[Optional[int]], ids: List[Optional[List[int]]],
              block: Optional[int]) -> None:
        args, rep = self.args, self.report
        conds: List[Dict[str, Any]] = []
        for phase in ("baseline", "replay"):
            rep[phase] = dict(zip(("counters", "counters_unavailable"), self.deltas(phase)))
        bad = [f"{ph} {r.id}: {r.error}" for ph, recs in (("baseline", base), ("replay", again))
               for r in recs if not r.ok]
        conds.append({"name": "requests", "passed": not bad,
                      "detail": f"{2 * len(self.rows) - len(bad)}/{2 * len(self.rows)} succeeded"
                                + (f"; {'; '.join(bad[:3])}" if bad else "")})
        rule = args.expect_hit_tokens
        if rule == "any":
            want, basis = 1, "any: more than zero"
        elif rule.isdigit():
            want, basis = int(rule), "--expect-hit-tokens"
        elif block is None:
            want, basis = None, "block size unknown (no vllm:cache_config_info): pass --block-size"
        else:
            want, basis = expected_hit_tokens(counts, ids, block)
        got = rep["replay"]["counters"][mt.CONNECTOR_HIT_TOKENS]
        rep["expected_hit_tokens"] = {"rule": rule, "tokens": want, "basis": basis}
        rep["observed_hit_tokens"] = got
        if self.daemon_url:   # the daemon's own count of the same replay, side by side
            rep["daemon_hit_tokens"] = rep["replay"]["counters"][mt.DAEMON_HIT_TOKENS]
        if got == mt.UNAVAILABLE:
            ok, detail = False, f"{mt.CONNECTOR_HIT_TOKENS} unavailable: " \
                                f"{rep['replay']['counters_unavailable'][mt.CONNECTOR_HIT_TOKENS]}"
        elif want is None or want < 1:
            ok, detail = False, (f"no expectation to check: {basis}" if want is None else
                                 "the prompts fill no block: expected 0 hit tokens (use longer "
                                 "prompts)")
        else:
            ok = got >= want
            detail = f"+{got} during the replay, expected >= {want} ({basis})"
        marks = [self.snaps[n]["vllm"].value(RESTART_MARK) for n in ("baseline_post", "replay_pre")]
        if not ok and None not in marks and marks[0] == marks[1]:
            detail += f"; {RESTART_MARK} did not change: was the server restarted?"
        conds.append({"name": "hit_tokens", "passed": ok, "detail": detail})
        names = list(ERROR_COUNTERS)
        # The daemon exports its disk checksum counter only with a disk tier: checked
        # where exported, and (unavailable, failing) where a daemon scrape failed.
        daemon = [snaps["daemon"] for snaps in self.snaps.values()] if self.daemon_url else []
        if any(not d.ok or mt.DAEMON_DISK_CHECKSUM_FAILURES in d.samples for d in daemon):
            names.append(mt.DAEMON_DISK_CHECKSUM_FAILURES)
        errs = []
        for phase in ("baseline", "replay"):
            for name in names:
                v = rep[phase]["counters"][name]
                if v == mt.UNAVAILABLE:
                    errs.append(f"{phase} {name} unavailable "
                                f"({rep[phase]['counters_unavailable'][name]})")
                elif v:
                    errs.append(f"{phase} {name} +{v}")
        conds.append({"name": "load_errors", "passed": not errs,
                      "detail": "; ".join(errs) if errs else f"0 in both phases ({', '.join(names)})"})
        pairs = [(a, z) for a, z in zip(base, again) if a.ok and z.ok]
        differ = [a.id for a, z in pairs if a.text != z.text]
        ok = bool(pairs) and not differ and len(pairs) == len(self.rows)
        detail = f"{len(pairs) - len(differ)}/{len(self.rows)} identical"
        if differ:
            detail += f"; differ: {', '.join(differ[:5])}"
        if len(pairs) < len(self.rows):
            detail += f"; {len(self.rows) - len(pairs)} not compared (a request failed)"
        conds.append({"name": "outputs", "passed": ok, "detail": detail})
        rep["conditions"] = conds


def render(rep: Dict[str, Any]) -> str:
    lines = [f"verify replay: {rep['verdict'].upper()}  ({rep.get('prompts_count')} prompts from "
             f"{rep.get('prompts')}, model {rep.get('model') or '?'})"]
    for c in rep.get("conditions") or ():
        lines.append(f"  [{'ok' if c['passed'] else 'FAIL':>4}] {c['name']:<12} {c['detail']}")
    if "daemon_hit_tokens" in rep:
        lines.append(f"  replay hit tokens: vLLM {rep.get('observed_hit_tokens')}, "
                     f"daemon {rep['daemon_hit_tokens']} ({mt.DAEMON_HIT_TOKENS})")
    if rep.get("failure"):
        lines.append(f"  failure: {rep['failure']['type']}: {rep['failure']['message']}")
    if rep["failed"]:
        lines.append("failed: " + ", ".join(rep["failed"]))
    return "\n".join(lines) + "\n"


def run(argv: Optional[Sequence[str]] = None) -> Tuple[int, Optional[Path]]:
    """The command, for scripts and tests: (exit status, path of the report or None)."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 0 if e.code is None else 2), None
    problem = next((msg for bad, msg in (
        (args.max_tokens is not None and args.max_tokens < 1, "--max-tokens must be positive"),
        (args.block_size is not None and args.block_size < 1, "--block-size must be positive"),
        (args.wait_seconds is not None and args.wait_seconds < 0, "--wait-seconds must be >= 0"),
        (args.wait_seconds is not None and args.restart_cmd is not None,
         "--wait-seconds and --restart-cmd exclude each other")) if bad), None)
    if problem:
        print(f"kvkeeper verify replay: {problem}", file=sys.stderr)
        return 2, None
    try:
        rows = read_jsonl(args.prompts, 32, args.max_tokens)
        check = Check(args, rows)
    except ValueError as e:
        print(f"kvkeeper verify replay: {e}", file=sys.stderr)
        return 2, None
    rep = check.report
    rep.update(prompts=str(args.prompts), prompts_sha256=sha256_file(args.prompts),
               prompts_count=len(rows), failure=None)
    try:
        check.go()
    except (BackendError, RestartError, OSError) as e:
        rep["failure"] = {"type": type(e).__name__, "message": str(e)}
        rep.setdefault("conditions", []).append(
            {"name": "backend", "passed": False, "detail": str(e).splitlines()[0]})
    except KeyboardInterrupt:
        rep["failure"] = {"type": "KeyboardInterrupt", "message": "interrupted"}
        rep.setdefault("conditions", []).append(
            {"name": "backend", "passed": False, "detail": "interrupted"})
    rep["failed"] = [c["name"] for c in rep["conditions"] if not c["passed"]]
    rep["verdict"] = "fail" if rep["failed"] else "pass"
    if args.out:
        out = args.out.resolve()
        folder = out.with_name(out.stem + "_metrics")
        for name, snaps in check.snaps.items():
            for who, snap in snaps.items():
                if snap.url:
                    rep["snapshots"][f"{name}_{who}"] = save_snapshot(
                        snap, folder / f"{name}_{who}.prom", out.parent)
        write_json(out, rep)
    sys.stdout.write(render(rep))
    return (0 if rep["verdict"] == "pass" else 1), (args.out.resolve() if args.out else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(argv)[0]
