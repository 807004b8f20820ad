"""What a run leaves behind: the environment it ran in, JSON files, metrics snapshots."""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from ..version import package_version
from .metrics_text import Snapshot


def environment(backend: Any = None, daemon_metrics_url: Optional[str] = None,
                served_models: Any = None) -> Dict[str, Any]:
    """Where and against what the run happened (backend: an openai_client.Backend)."""
    env: Dict[str, Any] = {
        "host": socket.gethostname(), "platform": platform.platform(),
        "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
        "kvkeeper_version": package_version(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "daemon_metrics_url": daemon_metrics_url,
    }
    if backend is not None:
        env["backend_url"] = backend.base_url
        env["backend_version"] = backend.version() or "unavailable"
    if served_models is not None:
        env["served_models"] = served_models
    return env


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def save_snapshot(snap: Snapshot, path: Path, root: Path) -> Dict[str, Any]:
    """Write the raw text (or why there is none); {"path" (relative to root), "ok", "error"}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(snap.raw(), encoding="utf-8")
    return {"path": os.path.relpath(path, root), "url": snap.url, "ok": snap.ok,
            "error": snap.error}
