"""YAML for people to read: keys in the order built, no anchors for repeated parts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO

import yaml


class _PlainDumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True  # a shared dict is written out again, not as &id001 / *id001


def dump_documents(documents: Iterable[dict], stream: IO[str]) -> None:
    yaml.dump_all(documents, stream, Dumper=_PlainDumper, sort_keys=False)
