"""The configuration reference, generated from the option declarations.

``python -m shmtier.options_doc > docs/configuration.md`` writes it: one table per section
of ``kv_connector_extra_config`` and per built-in tier type of the registry, each row an
option's key, default, what it accepts and its one-line description, as declared with
``shmtier.options.option``. ``tests/test_configuration_doc.py`` fails when the file in
the repository is not what this prints.

Who calls: a developer (or that test), in a process of its own; imports the config
classes (not torch, not vLLM); never blocks.
"""

from __future__ import annotations

import re
import sys

from shmtier.config import ConnectorKeys, PrimaryTierConfig, TierEntryKeys, TieringConfig
from shmtier.options import Options
from shmtier.scheduler.backpressure.validation import BackpressureOptions, ThrottledDropOptions
from shmtier.shared.codec import CompressionConfig
from shmtier.shared.pool_config import WorkerPoolOptions
from shmtier.tiers import registry

COMMAND = "python -m shmtier.options_doc > docs/configuration.md"

INTRO = f"""\
# Configuration reference

Generated from the option declarations (`shmtier/options.py`'s `option(default, check,
doc=...)` in each config class) by `{COMMAND}`; do not edit it by hand.

shmtier is configured through vLLM's `--kv-transfer-config`, in its
`kv_connector_extra_config` mapping: the keys of the sections below up to "A
`secondary_tiers` entry" sit at its top level (`null` counts as absent); each entry of
`secondary_tiers` takes the keys of a tier entry and of its tier type. Every invalid value
fails when vLLM builds the spec, with an error naming the key, the value and what is
accepted; an unknown key is an error too (with a did-you-mean hint). Per request,
`kv_transfer_params` may carry vLLM's `kv_load_tiers` (e.g. `[{{"medium": "cpu"}}]`: only
CPU tiers may serve loads), `max_load_tokens` and `max_offload_tokens`.
"""

#: (heading, what the section is, its options), in the order a config is read.
SECTIONS: list[tuple[str, str, type[Options]]] = [
    ("vLLM's connector keys",
     "Read by vLLM from the same mapping; shmtier checks them first (vLLM reads them with "
     "`bool()` / `int()`, so `\"false\"` would be true to it) and passes them on unchanged.",
     ConnectorKeys),
    ("CPU tier", "The primary tier: one POSIX shared-memory segment per engine.",
     PrimaryTierConfig),
    ("Tiering", "The secondary tiers and how chunks move between them.", TieringConfig),
    ("Tier worker pool",
     "The processes that do all tier I/O and compression for the worker-backed tiers.",
     WorkerPoolOptions),
    ("Compression",
     "`compression`: a mode (`\"auto\"`, `\"zstd\"`, `\"none\"`) or a mapping of these keys.",
     CompressionConfig),
    ("Backpressure",
     "A `backpressure` mapping, at the top level (every tier's default) or in a tier entry "
     "(overriding it key by key; `false` opts the tier out, `{}` gives the defaults). Under "
     "pressure whole cascade jobs to that tier are dropped (the CPU copy stays); a cascade "
     "that finds the tier workers' job ring full fails at once and makes the tier's detector "
     "drop the next one. A custom `backpressure_cls` takes the keys of its constructor.",
     BackpressureOptions),
    ("ThrottledDropPolicy's policy_kwargs",
     "`policy_kwargs` of the default policy.", ThrottledDropOptions),
    ("A secondary_tiers entry",
     "Keys every entry of `secondary_tiers` may carry besides its tier type's own.",
     TierEntryKeys),
]


def _markdown(text: str) -> str:
    """A docstring's first paragraph as Markdown: reST roles and double backquotes
    become plain code spans."""
    first = " ".join(text.strip().split("\n\n")[0].split())
    first = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", first)
    return first.replace("``", "`")


def sections() -> list[tuple[str, str, type[Options]]]:
    """Every section: the fixed ones, then one per built-in tier type with options."""
    out = list(SECTIONS)
    for tier in registry.BUILT_IN:
        cls = tier.config_class()
        if cls.declared():
            out.append((f"{tier.name} tier", f'`"type": "{tier.name}"`. '
                        + _markdown(cls.__doc__ or ""), cls))
    return out


def table(cls: type[Options]) -> str:
    lines = ["| key | default | accepted | what it does |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in cls.reference_rows()]
    return "\n".join(lines)


def reference() -> str:
    """The whole of docs/configuration.md."""
    parts = [INTRO]
    for heading, about, cls in sections():
        parts.append(f"## {heading}\n\n{about}\n\n{table(cls)}\n")
    return "\n".join(parts)


def main() -> int:
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
