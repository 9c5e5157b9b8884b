"""Prometheus text exposition (format 0.0.4) for transport counters. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> list[str]:
    """Lines of one metric family: HELP, TYPE, then one line per (labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        v = int(value) if float(value).is_integer() else float(value)
        lines.append(f"{name}{_labels(labels)} {v}")
    return lines
