"""What the optimum's lead is made of: MIN that knows every think time but not
which conversations ended.

The offline optimum (policy_optimum.py) knows two things no online policy
does: which conversations ended (their history is never read again) and
when each live conversation's next turn comes. The told replay
(policy_liveness.py) gives a policy the first; this gives MIN only the
second. An ended conversation looks live: its last turn's blocks that
nobody reads again are believed read by a phantom next turn, a think time
later (drawn from the trace's own think times: the gaps between a request
and the first later one that extends its whole chain), and they leave when
that turn does not come, as a cache that knows think times would learn of
the end. Everything else MIN knows as before.

Which requests ended a conversation comes from the trace's last_turn marks
(the generator marks them; a recorded trace may not, and then this is the
optimum itself). The result bounds what knowing ends is worth on top of
knowing timing: optimum - blind. Where it is small, the optimum's lead over
an online policy is the timing of each next turn, which no client hint of an
end carries and no policy can infer from idle time.
"""
from __future__ import annotations

import math
import random
from typing import Optional, Sequence

from .policy_optimum import min_hits, next_uses
from .policy_trace import Request


def think_times(requests: Sequence[Request]) -> list[int]:
    """For each request that a later one extends whole (a conversation's next
    turn: its prompt holds the request's whole chain), the number of
    requests between them, to the first such."""
    ends: dict[bytes, int] = {}           # a chain's last key -> its request
    for i, r in enumerate(requests):
        ends.setdefault(r.keys[-1], i)
    gaps: list[int] = []
    for j, r in enumerate(requests):
        for k in r.keys[:r.prompt_blocks]:
            i = ends.get(k)
            if i is not None and i < j:
                gaps.append(j - i)
                del ends[k]               # the first continuation only
    return gaps


def blind_uses(requests: Sequence[Request], seed: int = 0,
               gaps: Optional[Sequence[int]] = None) -> list[list[float]]:
    """next_uses, where a last turn's blocks that no later lookup reads are
    believed read by a phantom next turn after a think time drawn from
    `gaps` (default: think_times of the trace). With no gaps, next_uses."""
    uses = next_uses(requests)
    gaps = list(think_times(requests) if gaps is None else gaps)
    if not gaps:
        return uses
    rng = random.Random(seed)
    starts: list[int] = []
    t = 0
    for r in requests:
        starts.append(t)
        t += len(r.keys)
    for i, r in enumerate(requests):
        if not r.last_turn:
            continue
        m = i + rng.choice(gaps)
        if m >= len(requests):            # due after the trace ends, as a live one may be
            continue
        # Key j at event starts[m] + j: a child is believed read after its
        # parent, as at a real lookup, so MIN still evicts children first.
        uses[i] = [starts[m] + j if nu == math.inf else nu for j, nu in enumerate(uses[i])]
    return uses


def blind_hits(requests: Sequence[Request], capacity: int, seed: int = 0,
               gaps: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) of MIN blind to ends (see above)."""
    return min_hits(requests, blind_uses(requests, seed, gaps), capacity)
