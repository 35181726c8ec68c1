"""The acme platform: arch names ``acme1`` / ``acme2``; it recognizes no torch device (tests run on the CPU)."""

import re

import torch

from dsa_indexer.dispatch import Platform, Target

ARCH = "acme1"
_NAME = re.compile(r"^acme\d$")


def _parse(name: str):
    return Target("acme", name.lower()) if _NAME.match(name.lower()) else None


PLATFORM = Platform(vendor="acme", archs=("acme1", "acme2"), parse=_parse, detect=lambda device: None,
                    fp8_dtypes={"acme2": torch.float8_e4m3fnuz}, names="an acme arch (acme1, acme2)")
