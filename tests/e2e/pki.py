"""A throwaway certificate authority for mutual-TLS tests, made with the openssl CLI:
ca.pem, server.pem/.key (for 127.0.0.1 and localhost) and one pem/key pair
per client name, each with the subject CN=<name>."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

# EC keys: an order of magnitude faster to make than RSA on a busy machine.
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl() -> Optional[str]:
    return shutil.which("openssl")


def make_pki(d: Path, clients: Sequence[str] = ("client",)) -> Path:
    """Write the CA, the server's certificate and each client's into `d`; returns `d`."""
    exe = openssl()
    assert exe is not None, "openssl is not installed"

    def run(*args: str) -> None:
        subprocess.run([exe, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvkeeper test CA")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), *((c, []) for c in clients)):
        run("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={'kvkeeper server' if name == 'server' else name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext)
    return d
