"""The README's vLLM examples agree with the quick start and with what tests/serving runs."""
from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

from kvkeeper.client.url import parse_url
from kvkeeper.connector.config import ConnectorConfig
from kvkeeper.server.config import ListenSection
from serving_harness import README_DAEMON_URL, kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else len(README)]


def kv_configs(text: str) -> list:
    return [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", text, re.S)]


def default_socket() -> str:
    return next(f.default for f in fields(ListenSection) if f.name == "socket")


def test_the_vllm_examples_name_the_quick_starts_socket() -> None:
    quick_start = section("Quick start")
    assert f"socket `{default_socket()}`" in quick_start
    assert "kvkeeper serve`" in quick_start or "kvkeeper serve\n" in quick_start
    configs = kv_configs(section("Using it from vLLM"))
    assert len(configs) >= 2, "the plain `vllm serve` line and the CPU build's wrapper line"
    url = parse_url(README_DAEMON_URL)
    assert url.kind == "unix" and Path(url.path) == Path(default_socket())
    for cfg in configs:
        # What the serving fixture passes to its server, so CI runs the README's config.
        assert cfg == kv_transfer_config(README_DAEMON_URL)
        ConnectorConfig.from_extra(cfg["kv_connector_extra_config"], kv_role=cfg["kv_role"])


def test_the_cpu_example_names_files_that_exist() -> None:
    text = section("Using it from vLLM")
    for path in ("tests/serving/vllm_serve.py", "tests/connector/tiny_llama.py"):
        assert f".venv/bin/python {path}" in text
        assert (ROOT / path).is_file(), path
